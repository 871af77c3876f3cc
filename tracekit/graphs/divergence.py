"""Which piece broke: per-piece comparison of a graph (or compiled) forward against eager.

Because tracekit owns the piece runners of the piecewise backend, a watched forward can give every
piece's real inputs also to the piece's uncompiled FX module, run eagerly, and compare the outputs
(docs/GRAPHS.md, "Per-piece divergence").
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tracekit.graphs.piece_split import op_name
from tracekit.graphs.piecewise import PieceRunner, PiecewiseGraphBackend
from tracekit.numerics import compare_tensors


@dataclass(frozen=True)
class Tolerance:
    """A piece diverges when any output exceeds either bound."""

    max_abs: float = 1e-3
    relative_rms: float = 1e-3


@dataclass
class PieceDivergence:
    index: int
    name: str
    op_names: list[str]
    # How the piece ran in the watched forward: general, compiled, warmup, capture or replay.
    path: str
    max_abs: float
    relative_rms: float
    bit_exact: bool
    diverged: bool

    def to_plain(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class DivergenceReport:
    tolerance: Tolerance
    pieces: list[PieceDivergence] = field(default_factory=list)

    @property
    def first_divergent(self) -> PieceDivergence | None:
        return next((piece for piece in self.pieces if piece.diverged), None)

    def to_plain(self) -> dict[str, Any]:
        first = self.first_divergent
        return {
            "tolerance": vars(self.tolerance),
            "first_divergent": None if first is None else first.to_plain(),
            "pieces": [piece.to_plain() for piece in self.pieces],
        }


class _Probe:
    """What the piece runners call while a probe is armed (see `PieceRunner.__call__`)."""

    def __init__(self, tolerance: Tolerance):
        self.report = DivergenceReport(tolerance)

    def snapshot(self, args: tuple) -> tuple:
        # Copies, so a piece that mutates its inputs cannot change what the eager run sees.
        return tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)

    def observe(self, runner: PieceRunner, args_before: tuple, output: Any) -> None:
        graph_module = runner.spec.graph_module
        comparisons = [
            compare_tensors(actual, expected)
            for actual, expected, unset in zip(
                _outputs(output),
                _outputs(graph_module(*args_before)),
                _uninitialized_outputs(graph_module),
                strict=True,
            )
            if isinstance(actual, torch.Tensor) and not unset
        ]
        max_abs = max((c["max_abs"] for c in comparisons), default=0.0)
        relative_rms = max((c["relative_rms"] for c in comparisons), default=0.0)
        tolerance = self.report.tolerance
        self.report.pieces.append(
            PieceDivergence(
                index=runner.spec.index,
                name=runner.spec.name,
                op_names=runner.spec.op_names,
                path=runner.last_path,
                max_abs=max_abs,
                relative_rms=relative_rms,
                bit_exact=all(c["bit_exact"] for c in comparisons),
                diverged=max_abs > tolerance.max_abs or relative_rms > tolerance.relative_rms,
            )
        )


@contextlib.contextmanager
def probe(
    backend: PiecewiseGraphBackend, tolerance: Tolerance = Tolerance()
) -> Iterator[DivergenceReport]:
    """Within it, every piece the backend runs is also run eagerly and compared; the report fills
    in as forwards run. Watch one forward at a time (pieces are listed in call order)."""
    watcher = _Probe(tolerance)
    backend.probe = watcher
    try:
        yield watcher.report
    finally:
        backend.probe = None


# Allocations without contents: a piece returns them (or views of them: vLLM's attention output
# buffer is an `empty` reshaped per head) as output buffers for the splitting op after it, and
# their bytes mean nothing until that op runs.
_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided"}
_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "permute", "expand",
          "as_strided", "slice", "select", "narrow", "flatten", "unflatten", "contiguous"}


def _uninitialized_outputs(graph_module: torch.fx.GraphModule) -> list[bool]:
    (output_node,) = [node for node in graph_module.graph.nodes if node.op == "output"]
    return [_is_allocation(value) for value in _outputs(output_node.args[0])]


def _is_allocation(value: Any) -> bool:
    while isinstance(value, torch.fx.Node):
        name = op_name(value).removeprefix("aten::").split(".")[0]
        if name in _ALLOCATIONS:
            return True
        if name not in _VIEWS or not value.args:
            return False
        value = value.args[0]
    return False


def _outputs(output: Any) -> list[Any]:
    return list(output) if isinstance(output, (tuple, list)) else [output]
