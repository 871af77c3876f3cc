"""Autotuned Triton kernels on a real CUDA device: the recording process reads each kernel's
launched configuration by its lookup hash, and another process, given those choices, launches
the same configurations without timing its candidates — also a choice the other process would
not have made by itself, and also when its kernels are built in compile workers. And copies of
one kernel source, one per compiled graph, each given a configuration of its own, bit for bit as
that configuration runs (kernel_copies_script.py, as on the CPU in test_kernel_copies_cpu.py).
Skipped where CUDA is not available (CI)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import kernel_copies_checks as copies
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = Path(__file__).with_name("kernel_choices_script.py")


def run_script(work: Path, name: str, choices: list | None = None, compile_threads: int | None = 1) -> dict:
    """One fresh process with an Inductor cache of its own."""
    result = work / f"{name}.json"
    argv = [sys.executable, str(SCRIPT), str(result)]
    if choices is not None:
        (work / f"{name}-choices.json").write_text(json.dumps(choices))
        argv.append(str(work / f"{name}-choices.json"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{name}"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    if compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(result.read_text())


def by_hash(choices: list[dict]) -> dict[str, dict]:
    return {choice["source_hash"]: choice for choice in choices}


def with_config(choice: dict, config: dict) -> dict:
    """A recorded choice whose kernel, every copy of it included, ran with `config`."""
    return {**choice, "config": config, "copies": [{**copy, "config": config} for copy in choice.get("copies", [])]}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    work = tmp_path_factory.mktemp("kernel-choices")
    first = run_script(work, "record")
    tunable = {digest: options for digest, options in first["candidates"].items() if len(options) > 1}
    assert tunable, f"Inductor generated no kernel with several candidate configs: {first['candidates']}"
    return work, first, tunable


def test_every_kernel_with_a_choice_is_recorded_with_one_of_its_candidates(recorded):
    _, first, tunable = recorded
    launched = by_hash(first["launched"])
    assert set(tunable) <= set(launched), (sorted(tunable), sorted(launched))
    for digest, options in tunable.items():
        assert launched[digest]["config"] in options
        assert launched[digest]["origin"] == "timed"


@pytest.mark.parametrize("compile_threads", [1, None], ids=["in-process", "compile-workers"])
def test_a_recorded_choice_is_taken_instead_of_timing(recorded, compile_threads):
    """For each tunable kernel, a candidate other than the one this machine's timing picked."""
    work, first, tunable = recorded
    launched = by_hash(first["launched"])
    forced = []
    for digest, options in tunable.items():
        other = next(option for option in options if option != launched[digest]["config"])
        forced.append(with_config(launched[digest], other))
    second = run_script(work, f"forced-{compile_threads}", forced, compile_threads)
    again = by_hash(second["launched"])
    for choice in forced:
        assert again[choice["source_hash"]]["config"] == choice["config"], choice["kernel"]
    assert second["compared"]["same"] == sorted(choice["kernel"] for choice in forced)
    assert second["compared"]["other"] == []


def test_the_recordings_own_choices_reproduce_its_output(recorded):
    work, first, _ = recorded
    third = run_script(work, "same", first["launched"], compile_threads=None)
    assert third["checksum"] == first["checksum"]
    assert third["compared"]["other"] == [] and third["compared"]["unrecorded"] == []


def test_a_kernel_that_ran_otherwise_is_named(recorded):
    """Choices that are no candidate of the kernel (3 warps) cannot be taken: the kernel autotunes,
    and the comparison names it with both configurations."""
    work, first, _ = recorded
    bogus = [with_config(choice, {**choice["config"], "num_warps": 3}) for choice in first["launched"]]
    second = run_script(work, "bogus", bogus)
    assert len(second["compared"]["other"]) == len(bogus)
    recorded_parts = [line.split(" here, ")[1] for line in second["compared"]["other"]]
    assert all(part.endswith(" recorded") for part in recorded_parts)
    assert all("num_warps=3" in part.removesuffix(" recorded").split(",") for part in recorded_parts)


@pytest.mark.parametrize("compile_threads", [1, None], ids=["in-process", "compile-workers"])
def test_each_copy_of_a_kernel_runs_its_own_configuration(tmp_path, compile_threads):
    """Two compiled graphs binding copies of one reduction kernel: each copy recorded under its
    graph, each given a configuration of its own, bit for bit as that configuration runs. Built in
    the process, both graphs bind one `CachingAutotuner`; built in compile workers (how a process
    that found its graphs in vLLM's compile cache got its copies, issue 28), one each."""
    ran = copies.run_script(tmp_path, cpu=False, compile_threads=compile_threads)
    copies.check_each_copy_recorded_under_its_graph(ran)
    loaded = copies.copies_loaded(ran)
    if compile_threads == 1:
        assert len({entry["object"] for entry in loaded}) == 1 and not any(entry["worker_built"] for entry in loaded)
    else:
        assert len({entry["object"] for entry in loaded}) == 2 and all(entry["worker_built"] for entry in loaded), (
            "Inductor built the kernels in this process, not in its compile workers", loaded)
    copies.check_each_copy_runs_its_own_configuration(ran)
    copies.check_graph_keys_kept_across_cache_folders(ran)
