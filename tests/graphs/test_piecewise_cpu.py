"""The piecewise backend's split, per-size compile and fallback logic, and the divergence report,
on CPU (no capture: a table that asks for graphs is refused here)."""

import pytest
import torch
import torch.fx as fx
from graph_test_helpers import off_by_a_bit_at, run_dynamic
from toy_transformer import ATTENTION_OP, ToyTransformer

from tracekit.errors import CannotRunHere, UsageError
from tracekit.graphs import divergence
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.piece_split import split_at_ops
from tracekit.graphs.piecewise import PiecewiseGraphBackend

CPU = get_device_backend("cpu")


@torch.library.custom_op("tracekit_test::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x * 2


@pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _attention_twice(q, k, v, positions, k_cache, v_cache, out):
    q = q * 2
    torch.ops.tracekit_toy.attention(q, k, v, positions, k_cache, v_cache, out)
    torch.ops.tracekit_toy.attention.default(out, k, v, positions, k_cache, v_cache, out)
    return out + 1


def test_consecutive_splitting_ops_share_one_piece_between_the_others():
    split_gm, pieces = split_at_ops(fx.symbolic_trace(_attention_twice), [ATTENTION_OP])
    assert [(p.is_splitting_op, p.op_names) for p in pieces] == [
        (False, ["mul"]),
        (True, [ATTENTION_OP, ATTENTION_OP]),
        (False, ["add"]),
    ]
    assert [p.name for p in pieces] == [name for name, _ in split_gm.named_children()]


def test_a_tuple_is_unpacked_in_the_piece_that_makes_it():
    def uses_pair(x):
        first, second = torch.ops.tracekit_test.pair(x)
        return first + second

    _, pieces = split_at_ops(fx.symbolic_trace(uses_pair), ["tracekit_test::pair"])
    assert [p.op_names for p in pieces] == [["tracekit_test::pair", "getitem", "getitem"], ["add"]]


def _toy(layers=2):
    torch.manual_seed(0)
    return ToyTransformer(hidden=64, heads=2, layers=layers, slots=32)



def test_compile_sizes_are_compiled_once_and_other_sizes_fall_back():
    model = _toy()
    backend = PiecewiseGraphBackend(
        CaptureTable(mode="none", capture_sizes=(4, 8), compile_sizes=(4,)), [ATTENTION_OP], CPU
    )
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions = torch.randint(0, 512, (8,)), torch.arange(8)
    with torch.no_grad():
        for size in (4, 3, 4, 8):
            actual = run_dynamic(compiled, (ids, positions), size)
            assert torch.equal(actual, model(ids[:size], positions[:size]))
    (forward,) = backend.forwards
    pieces = [spec.index for spec in forward.specs if not spec.is_splitting_op]
    assert pieces == [0, 2, 4]
    assert [spec.op_names for spec in forward.specs if spec.is_splitting_op] == [[ATTENTION_OP]] * 2
    counters = backend.counters
    assert counters.compiled == [(p, None) for p in pieces] + [(p, 4) for p in pieces]
    # Size 8 is a capture size, but mode "none" captures nothing: it runs the general piece.
    assert counters.fallbacks == {(p, size): 1 for p in pieces for size in (3, 8)}
    assert not counters.captured and not counters.warmups and not counters.replays


def test_a_table_that_asks_for_graphs_is_refused_on_cpu():
    with pytest.raises(CannotRunHere):
        PiecewiseGraphBackend(
            CaptureTable(mode="piecewise", capture_sizes=(4,)), [ATTENTION_OP], CPU
        )
    backend = PiecewiseGraphBackend(CaptureTable(mode="piecewise", capture_sizes=()), [], CPU)
    with pytest.raises(UsageError):
        backend(fx.symbolic_trace(lambda x: x + 1), [torch.ones(2)])



def test_divergence_report_names_the_first_wrong_piece_and_its_ops():
    model = _toy()
    backend = PiecewiseGraphBackend(
        CaptureTable(mode="none", capture_sizes=(), compile_sizes=(4,)),
        [ATTENTION_OP],
        CPU,
        compiler=off_by_a_bit_at(2),
    )
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions = torch.randint(0, 512, (8,)), torch.arange(8)
    with torch.no_grad():
        run_dynamic(compiled, (ids, positions), 3)
        with divergence.probe(backend) as report:
            run_dynamic(compiled, (ids, positions), 4)
    # Each piece is judged on the inputs it got: the one after the wrong one is right.
    assert [(p.index, p.path, p.diverged) for p in report.pieces] == [
        (0, "compiled", False), (2, "compiled", True), (4, "compiled", False)
    ]
    assert report.pieces[0].bit_exact and report.pieces[2].bit_exact
    first = report.first_divergent
    assert first.name == "submod_2" and first.max_abs == pytest.approx(0.01, rel=1e-3)
    assert "linear" in first.op_names and "gelu" in first.op_names
    assert report.to_plain()["first_divergent"]["index"] == 2
    assert backend.probe is None



def test_an_allocation_handed_on_through_views_is_not_compared():
    """A piece that returns a view of `empty` (vLLM's attention output buffer, reshaped per head)
    hands over bytes that mean nothing yet: the probe compares only the piece's real outputs."""

    def buffer_for_next_op(x):
        return x * 2, torch.empty(x.shape[0], 4).view(x.shape[0], 2, 2)

    def garbage_in_the_buffer(piece, example_args, size):
        def run(*args):
            doubled, buffer = piece.graph_module(*args)
            return doubled, buffer.fill_(1e6)

        return run

    backend = PiecewiseGraphBackend(CaptureTable(mode="none", capture_sizes=()), [], CPU,
                                    compiler=garbage_in_the_buffer)
    compiled = torch.compile(buffer_for_next_op, backend=backend, fullgraph=True)
    x = torch.ones(5, 4)
    torch._dynamo.mark_dynamic(x, 0)
    with divergence.probe(backend) as report:
        compiled(x)
    (piece,) = report.pieces
    assert piece.bit_exact and not piece.diverged and piece.max_abs == 0.0
