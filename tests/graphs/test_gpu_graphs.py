"""The graph layer on a real CUDA device: one-shot capture of the toy transformer, the piecewise
backend's warm-up/capture/replay/fallback cycle, its debug address check, and the divergence
report locating a wrong piece. Skipped where CUDA is not available (CI)."""

import pytest
import torch
from graph_test_helpers import off_by_a_bit_at, run_dynamic
from toy_transformer import ATTENTION_OP, ToyTransformer

from tracekit.graphs import divergence
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.modes import expand_modes, measure_mode
from tracekit.graphs.oneshot import capture_and_time
from tracekit.graphs.piecewise import GraphInputMoved, PiecewiseGraphBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 16


@pytest.fixture
def cuda():
    return get_device_backend("cuda")


@pytest.fixture
def model():
    torch.manual_seed(0)
    return ToyTransformer(hidden=256, heads=4, layers=2, slots=64).cuda()


@pytest.fixture
def inputs():
    """Static input buffers, sliced per batch size, as vLLM keeps them for graphs."""
    ids = torch.randint(0, 512, (MAX_TOKENS,), device="cuda")
    return ids, torch.arange(MAX_TOKENS, device="cuda")



@torch.no_grad()
def test_one_shot_graph_matches_eager_replays_identically_and_times_itself(cuda, model, inputs):
    ids, positions = inputs[0][:8], inputs[1][:8]
    result = capture_and_time(
        lambda: model(ids, positions), model.kv_caches(), cuda, iters=20, samples=5, warmup_s=0.2
    )
    report = result.report
    assert report["eager_repeat"]["bit_exact"]
    assert report["graph_vs_eager"]["max_abs"] < 1e-4
    assert report["graph_vs_eager"]["relative_rms"] < 1e-5
    assert report["graph_deterministic"] and report["finite"]
    assert report["state_reset_bytes"] == sum(c.numel() * 4 for c in model.kv_caches())
    assert torch.allclose(result.output, model(ids, positions), atol=1e-4)
    forward, replay = report["latency_us"], report["replay_us"]
    assert forward["timer"] == "graph_events" and forward["count"] == 100
    # The in-graph interval is the replay minus the restore and launch: inside it, not far off.
    assert 0.5 * replay["median"] <= forward["median"] <= replay["median"]
    print(f"\none-shot: forward {forward['median']:.1f} us, replay {replay['median']:.1f} us")


@torch.no_grad()
def test_the_state_restore_is_what_makes_replays_identical(cuda):
    torch.manual_seed(0)
    state = torch.ones(1024, device="cuda")
    weights = torch.randn(1024, device="cuda")

    def accumulating_forward():
        state.mul_(0.5).add_(weights)
        return state * 2

    restored = capture_and_time(accumulating_forward, [state], cuda, iters=2, samples=2, warmup_s=0)
    assert restored.report["graph_deterministic"]
    unrestored = capture_and_time(accumulating_forward, [], cuda, iters=2, samples=2, warmup_s=0)
    assert not unrestored.report["graph_deterministic"]


def _piecewise(cuda, table, compiler="eager"):
    return PiecewiseGraphBackend(table, [ATTENTION_OP], cuda, compiler=compiler)


@torch.no_grad()
def test_piecewise_captures_the_table_sizes_after_warmups_and_falls_back_for_others(
    cuda, model, inputs
):
    table = CaptureTable(mode="piecewise", capture_sizes=(4, 8), num_warmups=2)
    backend = _piecewise(cuda, table)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for size in (4, 4, 4, 4, 4, 3, 8, 8, 8, 8):
        expected = model(inputs[0][:size], inputs[1][:size])
        actual = run_dynamic(compiled, inputs, size)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    (forward,) = backend.forwards
    pieces = [spec.index for spec in forward.specs if not spec.is_splitting_op]
    counters = backend.counters
    assert counters.warmups == {(p, s): 2 for p in pieces for s in (4, 8)}
    assert counters.captured == [(p, 4) for p in pieces] + [(p, 8) for p in pieces]
    assert counters.replays == {**{(p, 4): 2 for p in pieces}, **{(p, 8): 1 for p in pieces}}
    assert counters.fallbacks == {(p, 3): 1 for p in pieces}
    # Only the first piece of each size collects garbage before its capture.
    assert counters.captures_with_gc_suppressed == 2 * (len(pieces) - 1)


@torch.no_grad()
def test_inductor_pieces_compile_the_compile_sizes_and_replay_them(cuda, model, inputs):
    table = CaptureTable(mode="piecewise", capture_sizes=(8,), compile_sizes=(8,), num_warmups=1)
    backend = _piecewise(cuda, table, compiler="inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for size in (8, 8, 8, 5):
        expected = model(inputs[0][:size], inputs[1][:size])
        actual = run_dynamic(compiled, inputs, size)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    pieces = [spec.index for spec in backend.forwards[0].specs if not spec.is_splitting_op]
    assert backend.counters.compiled == [(p, None) for p in pieces] + [(p, 8) for p in pieces]
    assert backend.counters.replays == {(p, 8): 1 for p in pieces}


@torch.no_grad()
def test_debug_mode_refuses_a_replay_whose_input_moved(cuda, model, inputs):
    table = CaptureTable(mode="piecewise", capture_sizes=(4,), num_warmups=0, debug=True)
    compiled = torch.compile(model, backend=_piecewise(cuda, table), fullgraph=True)
    run_dynamic(compiled, inputs, 4)
    run_dynamic(compiled, inputs, 4)
    moved = (inputs[0].clone(), inputs[1])
    with pytest.raises(GraphInputMoved, match="submod_0"):
        run_dynamic(compiled, moved, 4)



@torch.no_grad()
def test_divergence_report_locates_the_wrong_piece_in_graph_replays(cuda, model, inputs):
    table = CaptureTable(mode="piecewise", capture_sizes=(8,), compile_sizes=(8,), num_warmups=1)
    backend = _piecewise(cuda, table, compiler=off_by_a_bit_at(2))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    run_dynamic(compiled, inputs, 8)
    run_dynamic(compiled, inputs, 8)
    tolerance = divergence.Tolerance(max_abs=1e-4, relative_rms=1e-4)
    with divergence.probe(backend, tolerance) as report:
        run_dynamic(compiled, inputs, 8)
    assert [(p.index, p.path) for p in report.pieces] == [(i, "replay") for i in (0, 2, 4)]
    first = report.first_divergent
    assert first.index == 2 and first.max_abs == pytest.approx(0.01, rel=1e-2)
    assert "linear" in first.op_names
    assert [p.diverged for p in report.pieces] == [False, True, False]


@torch.no_grad()
def test_every_replay_mode_reports_timing_and_agreement_with_the_recording(cuda, model, inputs):
    ids, positions = inputs[0][:8], inputs[1][:8]
    expected = model(ids, positions)
    compiled = torch.compile(model, fullgraph=True)
    table = CaptureTable(mode="piecewise", capture_sizes=(8,), num_warmups=1)
    piecewise = _piecewise(cuda, table)
    piecewise_model = torch.compile(model, backend=piecewise, fullgraph=True)
    forwards = {
        "eager": lambda: model(ids, positions),
        "compiled": lambda: compiled(ids, positions),
        # (the replay engine's other forms of its model call: here the compiled forward too)
        "compiled-no-graph": lambda: compiled(ids, positions),
        "vllm-piecewise": lambda: compiled(ids, positions),
        "graph": lambda: model(ids, positions),
        "piecewise": lambda: run_dynamic(piecewise_model, inputs, 8),
    }
    reports = {
        mode: measure_mode(mode, forwards[mode], model.kv_caches(), expected, cuda,
                           iters=20, samples=3, warmup_s=0.2,
                           piecewise=piecewise if mode == "piecewise" else None)
        for mode in expand_modes("all")
    }
    for mode, report in reports.items():
        assert report["available"], mode
        assert report["vs_recorded"]["max_abs"] < 1e-4, mode
        assert report["latency_us"]["count"] == 60, mode
    assert reports["piecewise"]["piecewise"]["captured"]
    medians = {mode: round(report["latency_us"]["median"], 1) for mode, report in reports.items()}
    print(f"\nreplay modes, median us: {medians}")
    unbuilt = measure_mode("piecewise", forwards["eager"], [], expected, cuda, 1, 1)
    assert not unbuilt["available"] and "piecewise backend" in unbuilt["reason"]


@torch.no_grad()
def test_one_shot_capture_of_a_transformers_llama(cuda):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )
    llama = transformers.LlamaForCausalLM(config).cuda().eval()
    ids = torch.randint(0, 512, (1, 12), device="cuda")
    result = capture_and_time(
        lambda: llama(input_ids=ids, use_cache=False), [], cuda, iters=10, samples=3, warmup_s=0.2
    )
    assert result.report["graph_vs_eager"]["max_abs"] < 1e-4
    assert result.report["graph_deterministic"] and result.report["finite"]
    assert result.output.shape == (1, 12, 512)
