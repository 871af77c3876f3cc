"""How each piece of a split forward is compiled: not at all (its FX module as traced), or by
Inductor, for the general shape or one size.
"""

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tracekit.graphs.piece_split import PieceSpec


class PieceCompiler(Protocol):
    """Compiles one piece: for the general (symbolic) shape when `size` is None, with fake example
    arguments, else for that size with the real arguments of its first run."""

    def __call__(self, piece: PieceSpec, example_args: Sequence[Any], size: int | None) -> Callable:
        ...


def eager_pieces(piece: PieceSpec, example_args: Sequence[Any], size: int | None) -> Callable:
    """No compilation: the piece's FX module runs as traced."""
    return piece.graph_module


def inductor_pieces(piece: PieceSpec, example_args: Sequence[Any], size: int | None) -> Callable:
    """Inductor, as `torch.compile`'s default backend would compile the piece."""
    from torch._inductor.compile_fx import compile_fx

    # Inductor's pre-grad passes rewrite the module in place; the original stays the eager
    # reference of the divergence report.
    return compile_fx(copy.deepcopy(piece.graph_module), list(example_args))
