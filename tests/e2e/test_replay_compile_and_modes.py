"""Issue 4: the compile mode is part of what a replay reproduces, and `--mode all` on CPU reports
what can run here (eager, and compiled where the engine compiles) and why graph modes cannot;
`--json` carries the timing statistics. Issue 9: it also reports per-piece agreement of
Inductor-compiled pieces with eager through the piecewise backend's divergence probe.

What the modes do does not depend on the model runner, so these run on V1 only; that V2's
compiled steps replay bit-exact compiled is `test_replay_step_kinds`' (on both runners)."""

import json

import pytest
from e2e_support import STEP_KINDS, only_on_runner, read_content, read_step, tracekit

from tracekit.graphs.modes import OWN_ENGINE_MODES

pytestmark = [pytest.mark.slow, only_on_runner("v1")]

LATENCY_KEYS = {"median", "mean", "min", "p90", "std", "samples_us", "sample_spread_pct"}
ITERS, SAMPLES = 2, 3


def replay_all_modes(bundle, tmp_path, runner):
    out = tmp_path / "replay.json"
    finished = tracekit(
        "replay", bundle, "--mode", "all", "--iters", ITERS, "--samples", SAMPLES, "--json", out, runner=runner
    )
    return finished, (json.loads(out.read_text()) if out.exists() else None)


def assert_timed(report):
    assert report["available"] is True
    latency = report["latency_us"]
    assert LATENCY_KEYS <= set(latency)
    assert len(latency["samples_us"]) == ITERS * SAMPLES and all(sample > 0 for sample in latency["samples_us"])
    assert min(latency["samples_us"]) <= latency["median"] <= max(latency["samples_us"])
    assert latency["min"] <= latency["median"] <= latency["p90"]


def assert_graph_modes_unavailable(result):
    for mode in OWN_ENGINE_MODES:
        assert result["modes"][mode]["available"] is False and result["modes"][mode]["reason"]


def assert_no_vllm_graphs(result):
    """vLLM's own PIECEWISE graphs of the padded size: a CPU engine captures none."""
    piecewise = result["modes"]["vllm-piecewise"]
    assert piecewise["available"] is False and "no PIECEWISE CUDA graph" in piecewise["reason"], piecewise


def assert_pieces_probed_against_eager(result):
    """On CPU the piecewise mode cannot capture, but its engine compiles the model's pieces with
    Inductor and the divergence probe runs each against its eager FX module: one piece before
    the first attention, one between consecutive layers' attentions, one after the last."""
    divergence = result["modes"]["piecewise"]["divergence"]
    assert divergence["pieces_compiled_with"] == "inductor" and divergence["pieces_captured"] is False
    num_layers = len(read_step(result["bundle"]).kv.groups[0].layer_names)
    pieces = divergence["pieces"]
    assert len(pieces) == num_layers + 1 and all(piece["path"] == "general" for piece in pieces)
    # Inductor's fusions round differently from eager kernels; an order of magnitude more, not a bug.
    assert all(piece["max_abs"] < 1e-4 and piece["relative_rms"] < 1e-5 for piece in pieces), pieces
    assert divergence["first_divergent"] is None


def test_eager_bundle_all_modes(builtin_bundles, tmp_path, runner_kind):
    mixed = next(p for p in builtin_bundles.values() if STEP_KINDS["mixed"](read_step(p)))
    finished, result = replay_all_modes(mixed, tmp_path, runner_kind)
    assert finished.returncode == 0, finished.explain()
    assert result["reference_mode"] == "eager" and result["bit_exact"]
    assert_timed(result["modes"]["eager"])
    assert result["modes"]["eager"]["vs_recorded"]["bit_exact"]
    for mode in ("compiled", "compiled-no-graph"):
        assert result["modes"][mode]["available"] is False and "compil" in result["modes"][mode]["reason"]
    assert_no_vllm_graphs(result)
    assert result["mode_agreement"] is None  # one mode ran: nothing to agree
    assert_graph_modes_unavailable(result)
    assert_pieces_probed_against_eager(result)
    assert "unavailable here" in finished.stdout


def test_compiled_bundle_replays_bit_exact_compiled_with_all_modes(compiled_bundle, tmp_path, runner_kind):
    content = read_content(compiled_bundle)
    assert content.engine.engine_args["compilation_config"]["mode"] != 0
    assert content.steps[0].graph.compilation_mode != "NONE"
    finished, result = replay_all_modes(compiled_bundle, tmp_path, runner_kind)
    assert finished.returncode == 0, finished.explain()
    assert result["reference_mode"] == "compiled" and result["bit_exact"]
    assert_timed(result["modes"]["eager"])
    assert_timed(result["modes"]["compiled"])
    assert result["modes"]["compiled"]["vs_recorded"]["bit_exact"]
    # Without graphs (a CPU engine) vLLM's dispatch had nothing to bypass: the same compiled code.
    assert_timed(result["modes"]["compiled-no-graph"])
    assert_no_vllm_graphs(result)
    # The eager mode really runs eagerly on a compiled engine: it rounds differently, and the
    # replay says the modes disagree (the check that finds a graph giving other values than eager).
    assert not result["modes"]["eager"]["vs_recorded"]["bit_exact"]
    agreement = result["mode_agreement"]
    assert agreement["agree"] is False and list(agreement["parted"]) == ["eager"], agreement
    assert agreement["bit_exact_with_recording"] == ["compiled", "compiled-no-graph"] and agreement["nonfinite"] == []
    assert "modes disagree" in finished.stdout
    assert_graph_modes_unavailable(result)


def test_compiled_bundle_forced_eager_does_not_reproduce(compiled_bundle, tmp_path, runner_kind):
    """Eager and compiled forwards round differently from the first layer's fused K/V
    projection on: the first divergence in forward order is the layer-0 KV the step writes."""
    out = tmp_path / "eager.json"
    finished = tracekit("replay", compiled_bundle, "--enforce-eager", "--json", out, runner=runner_kind)
    assert finished.returncode == 1, finished.explain()
    result = json.loads(out.read_text())
    assert result["reference_mode"] == "eager" and result["overrides"] == {"enforce_eager": True}
    first_layer = read_content(compiled_bundle).steps[0].kv.groups[0].layer_names[0]
    assert result["first_divergence"] == f"kv_written/{first_layer}", result["checks"]
    checks = {check["item"]: check for check in result["checks"]}
    assert checks["input_ids"]["bit_exact"] and checks["positions"]["bit_exact"]
    assert not checks["hidden_states"]["bit_exact"] and checks["hidden_states"]["max_abs"] < 1e-3
