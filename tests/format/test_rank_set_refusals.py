"""Issue 10: `tracekit inspect` of one rank's bundle shows the whole set, and `tracekit replay`
refuses, before any engine starts, a set it cannot replay: a missing rank or a part of another
step (exit 2), a parallel layout this machine cannot build, or pipeline parallel (exit 3)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rank_set_forge import make_set

TRACEKIT = str(Path(sys.executable).with_name("tracekit"))


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([TRACEKIT, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("tracekit: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_inspect_of_one_part_shows_the_set_and_what_is_missing(tmp_path):
    rank0, rank1 = make_set(tmp_path)
    whole = json.loads(_run("inspect", rank1, "--json").stdout)["rank_set"]
    assert whole["complete"] and whole["this_rank"] == 1 and set(whole["parts"]) == {"0", "1"}
    rank1.unlink()
    shown = _run("inspect", rank0)
    assert shown.returncode == 0, shown.stderr
    assert "rank 0 of 2 (TP=2, PP=1) of step 3" in shown.stdout
    assert "rank 1: missing" in shown.stdout and "set incomplete" in shown.stdout


def test_replay_of_a_set_with_a_missing_rank_is_bad_input(tmp_path):
    rank0, rank1 = make_set(tmp_path)
    rank1.unlink()
    result = _run("replay", rank0)
    assert result.returncode == 2
    assert "rank 1 (expected at" in _error_line(result) and "missing" in _error_line(result)


def test_replay_of_ranks_from_different_steps_is_bad_input(tmp_path):
    (tmp_path / "later").mkdir()
    rank0, rank1 = make_set(tmp_path)
    rank1.write_bytes(make_set(tmp_path / "later", step=4)[1].read_bytes())
    result = _run("replay", rank0)
    assert result.returncode == 2
    assert "do not belong together" in _error_line(result) and "step 4" in _error_line(result)


def test_replay_of_more_ranks_than_this_machine_can_build_cannot_run_here(tmp_path):
    pytest.importorskip("vllm")
    from tracekit.graphs.device import default_device
    from tracekit.integrations.vllm.engines.ranks import ranks_this_machine_can_build

    here = ranks_this_machine_can_build(default_device())
    parts = make_set(tmp_path, tp=here + 1)  # one rank more than there are cores (or devices)
    result = _run("replay", parts[-1])
    assert result.returncode == 3
    assert f"recorded with TP={here + 1}" in _error_line(result)
    assert f"this machine can build at most {here} rank(s)" in _error_line(result)


def test_replay_of_a_pipeline_parallel_set_is_refused_with_the_reason(tmp_path):
    pytest.importorskip("vllm")
    parts = make_set(tmp_path, tp=1, pp=2)
    result = _run("replay", parts[0])
    assert result.returncode == 3
    assert "PP=2" in _error_line(result) and "does not record or replay pipeline-parallel" in _error_line(result)


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--from", "1"], ["--repeats", "5"], ["--full-engine"],
                                   ["--lora", "a=/tmp"], ["--mode", "eager"], ["--plot", "p.png"]])
def test_an_option_a_multi_rank_replay_cannot_honour_is_refused_not_ignored(tmp_path, flags):
    rank0, _ = make_set(tmp_path)
    flags = [str(tmp_path / flag) if flag == "p.png" else flag for flag in flags]
    result = _run("replay", rank0, *flags)
    assert result.returncode == 2, result.stderr
    assert flags[0] in _error_line(result) and "multi-rank" in _error_line(result)
    assert not (tmp_path / "p.png").exists()
