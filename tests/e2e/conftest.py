"""Session fixtures for the end-to-end tests: each workload is recorded ONCE (one bundle per
step), and bundles recorded with the same engine configuration are replayed together on ONE
engine; tests then pick bundles by the kind of step their metadata describes."""

import pytest

from e2e_support import bundles_by_step, engine_script, of_kind, tracekit


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def builtin_bundles(e2e_dir):
    """Every step of `tracekit record`'s built-in workload (prefill, chunked prefill, decode;
    greedy, seeded, unseeded sampling, penalties), eager, one bundle per step."""
    out = e2e_dir / "builtin"
    out.mkdir()
    finished = tracekit("record", "--enforce-eager", "-o", out / "step{step}.zst", "--steps", "0:60")
    assert finished.returncode == 0, finished.explain()
    return bundles_by_step(out)


def _scenario(e2e_dir, name):
    out = e2e_dir / name
    out.mkdir()
    result = engine_script("record_scenario", e2e_dir / f"{name}.json", out, name)
    assert result["written"] and not result["failures"], result
    return bundles_by_step(out)


@pytest.fixture(scope="session")
def prefix_cache_bundles(e2e_dir):
    """Two generate calls one after the other sharing a 96-token prefix, every step recorded."""
    return _scenario(e2e_dir, "prefix_cache")


@pytest.fixture(scope="session")
def preemption_bundles(e2e_dir):
    """Four long greedy generations in a KV cache of 12 blocks, every step recorded."""
    return _scenario(e2e_dir, "preemption")


@pytest.fixture(scope="session")
def recorder_behaviour(e2e_dir):
    """The JSON of `engine_scripts/recorder_behaviour.py` (and its folders under `work`)."""
    work = e2e_dir / "behaviour"
    work.mkdir()
    return {**engine_script("recorder_behaviour", e2e_dir / "behaviour.json", work), "work": work}


@pytest.fixture(scope="session")
def eager_replays(e2e_dir, builtin_bundles, prefix_cache_bundles, recorder_behaviour):
    """All default-engine bundles (built-in workload, prefix cache, the failing step) replayed
    on one engine through the Python API."""
    bundles = [*builtin_bundles.values(), *prefix_cache_bundles.values(), *recorder_behaviour["exception_written"]]
    return engine_script("replay_many", e2e_dir / "eager_replays.json", *bundles)


@pytest.fixture(scope="session")
def preemption_replays(e2e_dir, preemption_bundles):
    """The resumed steps of the preemption workload, and the step before the first of them."""
    resumed = of_kind(preemption_bundles, "resumed_after_preemption")
    assert resumed, "the tiny KV cache did not force a preemption and resume"
    chosen = {min(resumed) - 1: preemption_bundles[min(resumed) - 1], **resumed}
    return engine_script("replay_many", e2e_dir / "preemption_replays.json", *chosen.values())


@pytest.fixture(scope="session")
def compiled_bundle(e2e_dir):
    """The built-in workload's step 1 (mixed) recorded with torch.compile, as vLLM runs by default."""
    out = e2e_dir / "compiled"
    out.mkdir()
    finished = tracekit("record", "-o", out / "mixed.zst", "--steps", "1")
    assert finished.returncode == 0, finished.explain()
    return out / "mixed.zst"
