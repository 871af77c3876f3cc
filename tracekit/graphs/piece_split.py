"""Splitting a traced forward into pieces at named ops, as vLLM splits a model at attention.

The pieces between splitting ops are what the piecewise backend compiles and captures; the runs
of splitting ops themselves stay eager (`tracekit.graphs.piecewise`).
"""

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module


@dataclass
class PieceSpec:
    """One piece of the split forward: its submodule name, position, the ops it holds, and whether
    it is a run of splitting ops (run eagerly, never captured)."""

    index: int
    name: str
    graph_module: fx.GraphModule
    op_names: list[str]
    is_splitting_op: bool


def op_name(node: fx.Node) -> str:
    """A readable name for what a node runs: "ns::op" for registered ops, else the function,
    method or module name."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target))


def is_splitting_op(node: fx.Node, splitting_ops: Sequence[str]) -> bool:
    """Whether `node` calls one of `splitting_ops`, named "ns::op" or "ns::op.overload"."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in splitting_ops
    if isinstance(target, torch._ops.OpOverload):
        return (
            target.name() in splitting_ops
            or f"{target.name()}.{target._overloadname}" in splitting_ops
        )
    return False


def split_at_ops(
    gm: fx.GraphModule, splitting_ops: Sequence[str]
) -> tuple[fx.GraphModule, list[PieceSpec]]:
    """Split `gm` before and after every run of consecutive splitting ops, keeping node order
    (the graph mutates state in place, so order is semantics)."""
    piece_of: dict[fx.Node, int] = {}
    splitting_pieces: set[int] = set()
    piece, in_split_run = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(source, fx.Node) and source in piece_of:
            # Unpack a tuple where it is made, so no piece receives a whole tuple.
            piece_of[node] = piece_of[source]
            continue
        splits = is_splitting_op(node, splitting_ops)
        if splits != in_split_run:
            piece += 1
            in_split_run = splits
        piece_of[node] = piece
        if splits:
            splitting_pieces.add(piece)
    split_gm = split_module(gm, gm, lambda node: piece_of[node], keep_original_order=True)
    pieces = []
    for name, module in split_gm.named_children():
        number = int(name.removeprefix("submod_"))
        pieces.append(
            PieceSpec(
                index=number,
                name=name,
                graph_module=module,
                op_names=[
                    op_name(node)
                    for node in module.graph.nodes
                    if node.op in ("call_function", "call_method", "call_module")
                ],
                is_splitting_op=number in splitting_pieces,
            )
        )
    pieces.sort(key=lambda spec: spec.index)
    return split_gm, pieces
