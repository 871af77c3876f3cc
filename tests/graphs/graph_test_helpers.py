"""What the CPU and GPU graph tests share: calling a compiled toy model the way vLLM calls its
compiled models, and a piece compiler with a planted fault for the divergence report to find."""

import torch

from tracekit.graphs.piece_compilers import eager_pieces


def run_dynamic(compiled, inputs, size):
    """Call with the first `size` tokens of the static `inputs`, token dimension marked dynamic."""
    ids, positions = inputs[0][:size], inputs[1][:size]
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(positions, 0)
    return compiled(ids, positions)


def off_by_a_bit_at(piece_index):
    """A piece compiler that adds 0.01 to one piece's outputs at table sizes, and only there."""

    def compile_piece(piece, example_args, size):
        if size is None or piece.index != piece_index:
            return eager_pieces(piece, example_args, size)

        def wrong(*args):
            output = piece.graph_module(*args)
            return tuple(t + 0.01 for t in output) if isinstance(output, tuple) else output + 0.01

        return wrong

    return compile_piece
