"""Running real engines in fresh processes, and reading what they recorded.

Every engine runs in a subprocess (the `tracekit` CLI or a script in `engine_scripts/`) with its
engine core in-process and the hub offline; tests only read the bundles and JSON it leaves.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, Step
from tracekit.integrations.seam import RUNNER_KINDS  # noqa: F401 - the engine tests take the runner kinds from here

SCRIPTS = Path(__file__).parent / "engine_scripts"
TRACEKIT = Path(sys.executable).parent / "tracekit"
ENGINE_TIMEOUT_S = 600  # a bound on a hung engine, not on a slow machine: a loaded 2-core runner took 300 s
# The test harness that lets Model Runner V2 run on this CPU build (see its docstring).
V2_HARNESS = Path(__file__).parents[1] / "harness" / "v2_on_cpu"


def engine_env(runner: str = "v1") -> dict[str, str]:
    """The environment of an engine subprocess running vLLM's model runner `runner`."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if runner == "v2":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(V2_HARNESS), env.get("PYTHONPATH")]))
    return env


def only_on_runner(kind: str) -> Any:
    """Mark a test that uses the session's recordings to run only with runner `kind` (for what
    one runner kind has by nature: V1's generator states, V2's seeds)."""
    return pytest.mark.parametrize("runner_kind", [kind], indirect=True)


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f}s\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}"


def run(argv: list[str], cwd: Path | None = None, runner: str = "v1") -> Finished:
    started = time.perf_counter()
    done = subprocess.run(
        argv, cwd=cwd, env=engine_env(runner), capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
    )
    return Finished(done.returncode, done.stdout, done.stderr, time.perf_counter() - started)


def tracekit(*args: str, cwd: Path | None = None, runner: str = "v1") -> Finished:
    return run([str(TRACEKIT), *map(str, args)], cwd, runner)


def engine_script(name: str, result_path: Path, *args: Any, runner: str = "v1") -> dict[str, Any]:
    """Run `engine_scripts/NAME.py RESULT ARGS...`; return the JSON it wrote."""
    finished = run([sys.executable, str(SCRIPTS / f"{name}.py"), str(result_path), *map(str, args)], runner=runner)
    assert finished.returncode == 0, f"{name}.py failed: {finished.explain()}"
    return json.loads(result_path.read_text())


def read_step(path: str | Path) -> Step:
    """The bundle's (only) step, metadata only: tensors stay `{"$tensor": name}` references."""
    with open_bundle(path) as reader:
        return BundleContent.from_plain(reader.metadata).steps[0]


def read_content(path: str | Path) -> BundleContent:
    with open_bundle(path) as reader:
        return BundleContent.from_plain(reader.metadata)


def bundles_by_step(directory: Path) -> dict[int, Path]:
    """`stepN.zst` bundles of a directory, by the step index their metadata gives."""
    found = {read_step(path).index: path for path in directory.glob("step*.zst")}
    return dict(sorted(found.items()))


# What kind of step a bundle holds, from its metadata alone.

def is_prefill(request) -> bool:
    return request.is_prefill


def samples_this_step(request) -> bool:
    """A request whose scheduled tokens reach the end of its known tokens samples one."""
    return request.num_computed_tokens + request.num_scheduled_tokens >= len(request.prompt_token_ids) + len(
        request.output_token_ids
    )


def sampling(request) -> dict[str, Any]:
    """A request's sampling parameters as vLLM's fields (every one, not only those typed)."""
    return request.sampling_params.to_plain() if request.sampling_params is not None else {}


def is_greedy(request) -> bool:
    return sampling(request).get("temperature") == 0.0


def has_penalties(request) -> bool:
    params = sampling(request)
    return params.get("repetition_penalty", 1.0) != 1.0 or params.get("presence_penalty", 0.0) != 0.0 or params.get(
        "frequency_penalty", 0.0
    ) != 0.0


def new_request_computed_tokens(step: Step) -> dict[str, int]:
    """num_computed_tokens of the requests the scheduler sends this step for the first time."""
    return {new.req_id: new.num_computed_tokens for new in step.scheduler_output.scheduled_new_reqs}


STEP_KINDS = {
    "pure_prefill": lambda s: all(is_prefill(r) for r in s.requests),
    "pure_decode": lambda s: not any(is_prefill(r) for r in s.requests),
    "mixed": lambda s: any(is_prefill(r) for r in s.requests) and not all(is_prefill(r) for r in s.requests),
    # a later chunk of a prompt too long for one step's token budget
    "chunked_prefill": lambda s: any(
        0 < r.num_computed_tokens and r.num_computed_tokens < len(r.prompt_token_ids)
        and r.req_id not in new_request_computed_tokens(s)
        for r in s.requests
    ),
    "greedy_sampling": lambda s: any(is_greedy(r) and not has_penalties(r) and samples_this_step(r) for r in s.requests),
    "seeded_sampling": lambda s: any(
        sampling(r).get("seed") is not None and not is_greedy(r) and samples_this_step(r) for r in s.requests
    ),
    "unseeded_sampling": lambda s: any(
        sampling(r).get("seed") is None and not is_greedy(r) and samples_this_step(r) for r in s.requests
    ),
    "penalties": lambda s: any(has_penalties(r) and r.output_token_ids and samples_this_step(r) for r in s.requests),
    # a request samples while its min_tokens still masks the end of sequence
    "min_tokens": lambda s: any(
        len(r.output_token_ids) < (sampling(r).get("min_tokens") or 0) and samples_this_step(r) for r in s.requests
    ),
    "logprobs": lambda s: any(sampling(r).get("logprobs") is not None and samples_this_step(r) for r in s.requests),
    # the scheduler found part of a new request's prompt in the prefix cache
    "prefix_cache_hit": lambda s: any(computed > 0 for computed in new_request_computed_tokens(s).values()),
    # a request that had generated tokens recomputes them after it was preempted
    "resumed_after_preemption": lambda s: any(
        r.output_token_ids and r.num_computed_tokens < len(r.prompt_token_ids) + len(r.output_token_ids) - 1
        for r in s.requests
    ),
}


# The kinds of step `tracekit record`'s built-in workload produces (the others need scenarios).
BUILTIN_STEP_KINDS = (
    "pure_prefill",
    "pure_decode",
    "mixed",
    "chunked_prefill",
    "greedy_sampling",
    "seeded_sampling",
    "unseeded_sampling",
    "penalties",
    "min_tokens",
    "logprobs",
)


def of_kind(bundles: dict[int, Path], kind: str) -> dict[int, Path]:
    return {index: path for index, path in bundles.items() if STEP_KINDS[kind](read_step(path))}


# Items a replay must have compared for "bit-exact" to mean anything.
CORE_ITEMS = {"batch_order", "input_ids", "positions", "hidden_states", "logits", "sampled_token_ids"}


def assert_replayed_bit_exact(replays: dict[str, Any], bundles: dict[int, Path]) -> None:
    """Every bundle's replay (from `replay_many.py`) compared the core items and KV, all bit-exact."""
    assert bundles, "the workload produced no step of this kind"
    for index, path in bundles.items():
        result = replays["replays"][str(path)]
        assert "error" not in result, f"step {index}: {result.get('error')}"
        items = {check["item"] for check in result["checks"]}
        assert CORE_ITEMS <= items, f"step {index} compared only {sorted(items)}"
        assert any(item.startswith("kv_written/") for item in items), f"step {index} compared no KV"
        diverged = [check for check in result["checks"] if not check["bit_exact"]]
        assert result["bit_exact"] and not diverged, f"step {index} ({path.name}) diverged: {diverged}"


def past_the_vocabulary(metadata: dict[str, Any], tensors: Any) -> None:
    """A `rewrite_bundle` edit that makes a real failure inside vLLM: a prefill's first computed
    prompt token past the vocabulary (the eager engine raises IndexError in the embedding lookup;
    the compiled one's Inductor kernel aborts the process)."""
    step = metadata["steps"][0]
    requests = {request["req_id"]: request for request in step["requests"]}
    row = 0  # the forward's rows hold each request's scheduled tokens in batch order
    for req_id in step["batch_order"]:
        request = requests[req_id]
        if request["num_computed_tokens"] < len(request["prompt_token_ids"]):  # a prefill reads its prompt
            request["prompt_token_ids"][request["num_computed_tokens"]] = 1 << 24
            # the recorded forward read it too: the bundle stays consistent (a replay refuses one
            # whose requests and input ids disagree), so the failure is the engine's
            tensors[step["input_ids"]["$tensor"]][row] = 1 << 24
            return
        row += request["num_scheduled_tokens"]
    raise AssertionError("the step has no prefill")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


LONG_CONTEXT = 256


def long_context_decode(builtin_bundles):
    """The first decode-only step of several requests, one of them with a long context."""
    for path in of_kind(builtin_bundles, "pure_decode").values():
        step = read_step(path)
        if len(step.requests) > 1 and max(r.num_computed_tokens for r in step.requests) >= LONG_CONTEXT:
            return path, max(step.requests, key=lambda r: r.num_computed_tokens).req_id
    raise AssertionError("the built-in workload has no decode step beside a long context")
