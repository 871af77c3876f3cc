"""What the kernel-copy tests check of one run of kernel_copies_script.py, on this CPU
(test_kernel_copies_cpu.py, through Triton's interpreter) and on a GPU (test_gpu_kernel_choices.py,
its kernels built in the process or in Inductor's compile workers)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("kernel_copies_script.py")


def run_script(work: Path, cpu: bool, compile_threads: int | None = None) -> dict:
    """One fresh process, with Inductor and Triton caches of its own."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TRITON_CACHE_DIR": str(work / "triton")}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    if compile_threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    argv = [sys.executable, str(SCRIPT), str(work / "result.json"), *(["--cpu"] if cpu else [])]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((work / "result.json").read_text())


def copies_loaded(ran: dict) -> list[dict]:
    """The shared kernel as each graph bound it when it was loaded, in the run without choices."""
    shared = ran["shared"]
    return [entry for entry in ran["record"]["loaded"] if entry["hash"] == shared["hash"]]


def check_each_copy_recorded_under_its_graph(ran: dict) -> None:
    shared, record = ran["shared"], ran["record"]
    assert shared is not None, f"the two graphs share no kernel source: {record['loaded']}"
    assert shared["graph_a"] != shared["graph_b"]
    (choice,) = [choice for choice in record["launched"] if choice["source_hash"] == shared["hash"]]
    assert {(copy["graph"], copy["binding"]) for copy in choice["copies"]} == {
        (shared["graph_a"], shared["binding_a"]), (shared["graph_b"], shared["binding_b"])}
    assert len(shared["candidates"]) > 1, shared


def check_each_copy_runs_its_own_configuration(ran: dict) -> None:
    """The lookup table gives the kernel one configuration (`config`); each graph's copy is given
    its own: graph a's output is the one the first configuration gives, graph b's the one the
    second gives, though the two configurations round apart."""
    assert ran.get("pair") is not None, ("no two candidate configurations of the shared kernel round apart here, "
                                         f"so the test cannot tell them apart: {ran.get('references')}")
    first, second = (ran["references"][index]["outputs"] for index in ran["pair"])
    pinned = ran["pinned"]
    assert pinned["outputs"]["a"] == first["a"] and pinned["outputs"]["b"] == second["b"], (pinned, first, second)
    assert (first["a"], first["b"]) != (second["a"], second["b"])
    assert len(pinned["pinned"]) == 2 and pinned["unapplied"] == [], (pinned["pinned"], pinned["unapplied"])
    kernel = ran["applied"]["kernel"]
    assert pinned["compared"] == {"same": [kernel], "other": [], "unrecorded": [], "several": [], "unapplied": []}
    (launched,) = [choice for choice in pinned["launched"] if choice["source_hash"] == ran["shared"]["hash"]]
    assert sorted((copy["graph"], copy["config"]) for copy in launched["copies"]) == sorted(
        (copy["graph"], copy["config"]) for copy in ran["applied"]["copies"])


def check_graph_keys_kept_across_cache_folders(ran: dict) -> None:
    """Each run compiled in a cache folder of its own, after the earlier runs' graphs (its
    `# kernel path:` and `# AOT ID:` comments differ): its graphs' keys are the same."""
    assert ran["pinned"]["graphs"] == ran["record"]["graphs"] == {
        "a": [ran["shared"]["graph_a"]], "b": [ran["shared"]["graph_b"]]}
