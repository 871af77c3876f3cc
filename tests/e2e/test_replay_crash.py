"""A replay that fails inside vLLM ends with one line, the verdict `crashed` and exit 4 — never
a traceback, an abort as the last word, or a missing JSON record — and a suite goes on.

The failure is a real one: a prompt token past the vocabulary. The eager CPU engine raises an
IndexError in the embedding lookup (a Python exception); the compiled one runs Inductor's C++
kernel, whose bounds check aborts the process (SIGABRT, exit 134) — as a CUDA device-side
assert does on a GPU. With --keep-going the suite replays what is left in a new process."""

import json

import pytest
from e2e_support import only_on_runner, past_the_vocabulary, tracekit

from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow


@only_on_runner("v1")
def test_crashes_end_as_one_line_with_exit_4_and_the_suite_goes_on(compiled_bundle, builtin_bundles, tmp_path,
                                                                   runner_kind):
    from e2e_support import of_kind

    eager = next(iter(of_kind(builtin_bundles, "mixed").values()))
    poisoned_eager = rewrite_bundle(eager, tmp_path / "a-eager-poisoned.zst", past_the_vocabulary)
    poisoned_compiled = rewrite_bundle(compiled_bundle, tmp_path / "b-compiled-poisoned.zst", past_the_vocabulary)
    out = tmp_path / "suite.jsonl"
    finished = tracekit("replay", poisoned_eager, poisoned_compiled, compiled_bundle, "--keep-going", "--no-timing",
                        "--json", out, runner=runner_kind)
    assert finished.returncode == 4, finished.explain()
    records = {record["bundle"]: record for record in map(json.loads, out.read_text().splitlines())}
    python_failure, abort = records[str(poisoned_eager)], records[str(poisoned_compiled)]
    assert python_failure["verdict"] == "crashed" and python_failure["exit_code"] == 4
    assert python_failure["error"].startswith("IndexError"), python_failure["error"]
    assert abort["verdict"] == "crashed" and abort["exit_code"] == 4
    assert abort["error"] == "the replay process was killed by SIGABRT", abort["error"]
    assert records[str(compiled_bundle)]["verdict"] == "bit_exact", "the suite did not go on in a new process"
    assert "Traceback" not in finished.stdout + finished.stderr
    ours = [line for line in (finished.stdout + finished.stderr).splitlines() if "REPLAY FAILED" in line]
    assert ours and all("exit 4" in line for line in ours)


@only_on_runner("v1")
def test_a_single_bundle_that_crashes_still_writes_its_record(builtin_bundles, tmp_path, runner_kind):
    from e2e_support import of_kind

    eager = next(iter(of_kind(builtin_bundles, "mixed").values()))
    poisoned = rewrite_bundle(eager, tmp_path / "poisoned.zst", past_the_vocabulary)
    out = tmp_path / "one.json"
    finished = tracekit("replay", poisoned, "--json", out, runner=runner_kind)
    assert finished.returncode == 4, finished.explain()
    record = json.loads(out.read_text())
    assert record["verdict"] == "crashed" and record["step"] is not None and record["trigger"]
    verdict = next(line for line in finished.stdout.splitlines() if line.startswith("verdict "))
    assert verdict.startswith("verdict crashed: REPLAY FAILED") and "IndexError" in verdict, finished.stdout[-2000:]
