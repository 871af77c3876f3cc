"""Record every step of the workload on vLLM (0.26 or 0.34) on a GPU, per engine configuration, and replay
each bundle in a fresh process (`conftest.recording`): bit-exact on the real rows, through
vLLM's own dispatch at the recorded padded size and graph mode, with the negative controls
caught and a device-side assert ending as the verdict `crashed`."""

import pytest
from gpu_support import (
    CONFIGS,
    INSTALLED_SERIES,
    RECORD_ENV,
    bundles_by_step,
    checks_of,
    long_prompt_config,
    of_kind,
    read_content,
    read_step,
    sampling,
)
from negative_controls import assert_noise_caught

from tracekit.graphs.timing import DEVICE_EVENTS, QUEUED_DEVICE_EVENTS

# Step kinds of the CPU suite the built-in workload produces, plus GPU-only sampling.
STEP_KINDS = (
    "pure_prefill", "pure_decode", "mixed", "chunked_prefill", "greedy_sampling", "seeded_sampling",
    "unseeded_sampling", "penalties", "min_tokens", "logprobs",
)


def _replayed(recording, path):
    record = recording.records.get(str(path))
    assert record is not None, f"{path.name} has no replay record\n{recording.replay.explain()}"
    return record


def small_float_divergence(record, bound: float) -> bool:
    """Every discrete item equal, every float item within relative RMS `bound`."""
    return all(
        check["bit_exact"] or check.get("decides") is False
        or (check.get("dtype") is not None and check.get("relative_rms", float("inf")) <= bound)
        for check in record["checks"]
    )


def test_the_workload_was_recorded_and_replayed(recording):
    assert recording.records, recording.replay.explain()
    steps = sorted(recording.folder.glob("step*.zst"))
    assert len(steps) >= 10, [path.name for path in steps]
    exact = sum(_replayed(recording, path)["verdict"] == "bit_exact" for path in steps)
    assert exact == len(steps), f"{exact} of {len(steps)} bit-exact"


@pytest.mark.parametrize("kind", STEP_KINDS)
def test_every_step_kind_replays_bit_exact_on_its_real_rows(recording, kind):
    bundles = of_kind(bundles_by_step(recording.folder), kind)
    assert bundles, f"{recording.name}: the workload produced no {kind} step"
    for index, path in bundles.items():
        record = _replayed(recording, path)
        assert record["verdict"] == "bit_exact", (index, record.get("verdict_reason"), record.get("error"))
        checks = checks_of(record)
        assert {"input_ids", "positions", "hidden_states", "logits", "sampled_token_ids"} <= set(checks)
        assert any(item.startswith("kv_written/") for item in checks), index


def test_top_k_and_top_p_requests_replay_bit_exact(recording):
    sampled = []
    for path in bundles_by_step(recording.folder).values():
        step = read_step(path)
        if any(sampling(r).get("top_k", 0) > 0 or sampling(r).get("top_p", 1.0) < 1.0
               for r in step.requests):
            sampled.append(path)
    assert sampled
    for path in sampled:
        assert _replayed(recording, path)["verdict"] == "bit_exact", path.name


def test_the_replay_ran_each_step_as_the_engine_dispatched_it(recording):
    """Decode steps ran FULL graphs of a padded size, mixed ones PIECEWISE graphs (graph
    engines); eager engines ran no graph. The replay's dispatch is the recorded one."""
    modes = set()
    for path in bundles_by_step(recording.folder).values():
        record = _replayed(recording, path)
        dispatch = record["dispatch"]
        assert not dispatch["differences"], (path.name, dispatch["differences"])
        modes.add(dispatch["recorded"]["runtime_mode"])
    args = CONFIGS[recording.name][1]
    if "--enforce-eager" in args:
        assert modes == {"NONE"}
    elif "--compilation-config" in args:  # capture sizes up to the budget: mixed steps fit a graph
        assert {"FULL", "PIECEWISE"} <= modes, modes
    else:  # vLLM's capture sizes: a prefill chunk past the largest runs compiled without a graph
        assert "FULL" in modes, modes


def test_padding_rows_are_kept_restored_and_compared_apart(recording):
    padded = 0
    for path in bundles_by_step(recording.folder).values():
        step = read_step(path)
        if step.graph.num_tokens_padded <= step.graph.num_tokens:
            continue
        padded += 1
        checks = checks_of(_replayed(recording, path))
        for item in ("input_ids/padding", "hidden_states/padding"):
            assert item in checks and checks[item]["decides"] is False, (path.name, item)
        assert checks["input_ids/padding"]["bit_exact"], path.name  # restored from the bundle
    # Graphs pad the workload's staggered decodes. Not so the long-prompt workload's (budget 512,
    # H200, 2026-12-06): its short requests all start in the first step and finish together, so
    # its decodes are of 8 requests and then of 1, both capture sizes.
    if "--enforce-eager" not in CONFIGS[recording.name][1] and not long_prompt_config(recording.name):
        assert padded, "no step ran at a padded size"


def test_engine_settings_that_change_a_step_are_recorded(recording):
    content = read_content(next(iter(bundles_by_step(recording.folder).values())))
    args = content.engine.engine_args
    assert args["async_scheduling"] is ("--no-async-scheduling" not in CONFIGS[recording.name][1])
    assert content.engine.runner == CONFIGS[recording.name][0]
    assert content.environment.device_kind == "cuda" and content.engine.vllm_version.startswith(INSTALLED_SERIES + ".")
    for name, value in RECORD_ENV.get(recording.name, {}).items():  # the replay sets them from here
        assert content.environment.env_vars.get(name) == value, name


def test_forward_times_compare_like_with_like(recording):
    """The engine's model call and the replay's timed runs are both timed by device events, and
    the replay says how they compare (the ±5% target is a benchmark's: tools/bench_replay_timing.py)."""
    for path in bundles_by_step(recording.folder).values():
        record = _replayed(recording, path)
        # (a first forward whose host issue outlasted its head start is timed with the gaps in it)
        assert record["recorded"]["forward_timer"] in (QUEUED_DEVICE_EVENTS, DEVICE_EVENTS), path.name
        timed = record["modes"][record["reference_mode"]]
        assert timed["available"] and timed["latency_us"]["timer"] == QUEUED_DEVICE_EVENTS, (path.name, timed)
        assert timed["ratio_to_recorded"] > 0


def test_negative_controls_are_caught(recording):
    controls = recording.extra.paths
    assert "perturbed_kv" in controls and "device_assert" in controls
    perturbed = _replayed(recording, controls["perturbed_kv"])
    assert perturbed["verdict"] == "diverged" and perturbed["exit_code"] == 1
    assert perturbed["first_divergence"].startswith(("kv_written/", "hidden_states")), perturbed["first_divergence"]
    assert_noise_caught(recording.extra, recording.records)
    crashed = _replayed(recording, controls["device_assert"])
    assert crashed["verdict"] == "crashed" and crashed["exit_code"] == 4, crashed
    assert recording.replay.returncode == 1  # the worst of the suite: the diverged controls
    assert "Traceback" not in recording.replay.stderr, recording.replay.stderr[-3000:]
