"""Session fixtures for the end-to-end tests: each workload is recorded ONCE per vLLM model
runner kind (one bundle per step), and bundles recorded with the same engine configuration are
replayed together on ONE engine; tests then pick bundles by the kind of step their metadata
describes.

Every recording fixture depends on `runner_kind`, so every test that uses one runs once on V1
and once on Model Runner V2 (through the CPU test harness, `tests/harness/v2_on_cpu`). The
runner is passed to each engine subprocess explicitly: session fixtures are set up before any
function-scoped fixture could change the environment.
"""

import pytest
from e2e_support import BUILTIN_STEP_KINDS, RUNNER_KINDS, bundles_by_step, engine_script, of_kind, tracekit

# V2 runs its Triton kernels in Triton's interpreter: fewer tokens per request keep it inside
# the CI budget while every step kind still occurs (the long prompt's chunks still run beside
# the others' decodes, and the min_tokens request still samples under its minimum).
BUILTIN_MAX_TOKENS = {"v1": 12, "v2": 8}


@pytest.fixture(scope="session", params=RUNNER_KINDS)
def runner_kind(request):
    """The vLLM model runner every engine of this session parameter runs."""
    return request.param


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory, runner_kind):
    return tmp_path_factory.mktemp(f"e2e-{runner_kind}")


@pytest.fixture(scope="session")
def builtin_bundles(e2e_dir, runner_kind):
    """Every step of `tracekit record`'s built-in workload (prefill, chunked prefill, decode;
    greedy, seeded, unseeded sampling, penalties, min_tokens, logprobs), eager, one bundle per
    step."""
    out = e2e_dir / "builtin"
    out.mkdir()
    finished = tracekit(
        "record", "--enforce-eager", "-o", out / "step{step}.zst", "--steps", "0:60",
        "--max-tokens", BUILTIN_MAX_TOKENS[runner_kind], runner=runner_kind,
    )
    assert finished.returncode == 0, finished.explain()
    return bundles_by_step(out)


def _scenario(e2e_dir, name, runner_kind):
    out = e2e_dir / name
    out.mkdir()
    result = engine_script("record_scenario", e2e_dir / f"{name}.json", out, name, runner=runner_kind)
    assert result["written"] and not result["failures"], result
    return bundles_by_step(out)


@pytest.fixture(scope="session")
def prefix_cache_bundles(e2e_dir, runner_kind):
    """Two generate calls one after the other sharing a 96-token prefix, every step recorded."""
    return _scenario(e2e_dir, "prefix_cache", runner_kind)


@pytest.fixture(scope="session")
def preemption_bundles(e2e_dir, runner_kind):
    """Four long greedy generations in a KV cache of 10 blocks, every step recorded."""
    return _scenario(e2e_dir, "preemption", runner_kind)


@pytest.fixture(scope="session")
def recorder_behaviour(e2e_dir, runner_kind):
    """The JSON of `engine_scripts/recorder_behaviour.py` (and its folders under `work`)."""
    work = e2e_dir / "behaviour"
    work.mkdir()
    result = engine_script("recorder_behaviour", e2e_dir / "behaviour.json", work, runner=runner_kind)
    return {**result, "work": work}


@pytest.fixture(scope="session")
def eager_replays(e2e_dir, runner_kind, builtin_bundles, prefix_cache_bundles, recorder_behaviour):
    """All default-engine bundles (built-in workload, prefix cache, the failing step) replayed
    on one engine through the Python API."""
    bundles = [*builtin_bundles.values(), *prefix_cache_bundles.values(), *recorder_behaviour["exception_written"]]
    return engine_script("replay_many", e2e_dir / "eager_replays.json", *bundles, runner=runner_kind)


@pytest.fixture(scope="session")
def preemption_replays(e2e_dir, runner_kind, preemption_bundles):
    """The resumed steps of the preemption workload, and the step before the first of them."""
    resumed = of_kind(preemption_bundles, "resumed_after_preemption")
    assert resumed, "the tiny KV cache did not force a preemption and resume"
    chosen = {min(resumed) - 1: preemption_bundles[min(resumed) - 1], **resumed}
    return engine_script("replay_many", e2e_dir / "preemption_replays.json", *chosen.values(), runner=runner_kind)


@pytest.fixture(scope="session")
def compiled_bundles(e2e_dir, runner_kind):
    """Every step of the built-in workload recorded with torch.compile, as vLLM runs by default."""
    out = e2e_dir / "compiled"
    out.mkdir()
    finished = tracekit(
        "record", "-o", out / "step{step}.zst", "--steps", "0:60", "--max-tokens", BUILTIN_MAX_TOKENS[runner_kind],
        runner=runner_kind,
    )
    assert finished.returncode == 0, finished.explain()
    return bundles_by_step(out)


@pytest.fixture(scope="session")
def compiled_bundle(compiled_bundles):
    """The compiled workload's first mixed step (a prefill chunk beside decodes)."""
    return next(iter(of_kind(compiled_bundles, "mixed").values()))


@pytest.fixture(scope="session")
def compiled_replays(e2e_dir, runner_kind, compiled_bundles):
    """The first compiled step of each built-in step kind, replayed on one compiled engine (one
    per kind, not all: each compiled replay costs as much as an eager one, V2's far more)."""
    chosen = {}
    for kind in BUILTIN_STEP_KINDS:
        chosen.update(list(of_kind(compiled_bundles, kind).items())[:1])
    return engine_script("replay_many", e2e_dir / "compiled_replays.json", *chosen.values(), runner=runner_kind)


@pytest.fixture(scope="session")
def window_bundle(e2e_dir, runner_kind):
    """An 8-step window of the built-in workload from its first step, eager (`record --window`):
    the steps `builtin_bundles` recorded one by one, in one bundle."""
    out = e2e_dir / "window.zst"
    finished = tracekit(
        "record", "--enforce-eager", "-o", out, "--steps", "0", "--window", 8,
        "--max-tokens", BUILTIN_MAX_TOKENS[runner_kind], runner=runner_kind,
    )
    assert finished.returncode == 0, finished.explain()
    return out


@pytest.fixture(scope="session")
def window_scenario_bundles(e2e_dir, runner_kind):
    """Windows of 6 steps tiling a run with preemption and resume, one request sampling at random
    unseeded (`record_scenario.py windows`), by first step."""
    return _scenario(e2e_dir, "windows", runner_kind)
