"""GPU tests: real vLLM engines (0.26 or 0.34) on a CUDA device (marker `gpu`). Skipped, with the
reason, wherever there is no CUDA device or neither release (CI has neither); `tools/gpu_run.sh
--vllm 0.26|0.34` runs them on the GPU machine. Under a release without Model Runner V1 (0.34
removed it) every test of a V1 configuration is skipped, saying so.

Each engine configuration records the built-in workload (plus top-k/top-p requests, which run on
a GPU) once, every step a bundle, and replays all of them — with negative controls beside them —
in one fresh `tracekit replay` process, so one engine is built per configuration.
"""

import importlib.metadata
import json
import os

import pytest
from gpu_support import (
    CONFIGS,
    HAS_V1,
    INSTALLED_SERIES,
    RECORD_ENV,
    json_records,
    long_prompt_config,
    record_steps,
    tracekit,
)

# The releases the GPU machine has a kit for (../shared/gpu/).
GPU_SERIES = ("0.26", "0.34")


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA device (this machine has none)"
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "needs vLLM 0.26 or 0.34 (not installed; on the GPU machine: tools/gpu_run.sh --vllm 0.26|0.34)"
    if not version.startswith(tuple(series + "." for series in GPU_SERIES)):
        return f"needs vLLM {' or '.join(GPU_SERIES)} (installed: {version})"
    return None


def _runs_v1(item) -> bool:
    """A test of Model Runner V1: a V1 configuration or runner parameter, or marked `v1_runner`."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    runners = [CONFIGS[value][0] if value in CONFIGS else value for value in params.values() if isinstance(value, str)]
    return "v1" in runners or item.get_closest_marker("v1_runner") is not None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace("\\", "/") or item.get_closest_marker("cpu_side"):
            continue
        item.add_marker(pytest.mark.gpu)
        reason = reason or _skip_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif not HAS_V1 and _runs_v1(item):
            item.add_marker(pytest.mark.skip(reason=f"vLLM {INSTALLED_SERIES} has no Model Runner V1 (removed in 0.34)"))


def pytest_runtest_logreport(report):
    """Each failure's report as it happens, appended where TRACEKIT_GPU_FAILURES points
    (`tools/gpu_run.sh`): a run cut at the device call's time limit never reaches pytest's summary,
    and its failures would come back without a word of why."""
    path = os.environ.get("TRACEKIT_GPU_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as stream:
            stream.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-8000:]}\n")


# The built-in workload's requests, plus sampling only a GPU runs (V2's top-k/top-p kernel fails
# under Triton's CPU interpreter).
EXTRA_REQUESTS = [
    {"prompt": "Write a haiku about the sea", "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3},
    {"prompt": "List three prime numbers:", "temperature": 0.7, "top_p": 0.8},
]


# A prompt of ~1200 tokens (the tiny tokenizer's), chunked at a budget of 512 too.
LONG_PROMPT = {"prompt": " ".join(["every engine step of a long prompt is a chunk"] * 56), "temperature": 0.0}


def _write_prompts(path, extra):
    from tracekit.record.workload import BUILTIN_WORKLOAD

    lines = [{"prompt": request.prompt, **request.sampling} for request in BUILTIN_WORKLOAD] + EXTRA_REQUESTS + extra
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    return _write_prompts(tmp_path_factory.mktemp("prompts") / "gpu-workload.jsonl", [])


@pytest.fixture(scope="session")
def long_prompts_file(tmp_path_factory):
    return _write_prompts(tmp_path_factory.mktemp("prompts") / "gpu-workload-long.jsonl", [LONG_PROMPT])


class Recording:
    """One configuration's recorded steps and their replay in one fresh process."""

    def __init__(self, name, folder, replay, records, extra):
        self.name, self.folder, self.replay, self.records, self.extra = name, folder, replay, records, extra


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def recording(request, tmp_path_factory, prompts_file, long_prompts_file):
    from negative_controls import make_negative_controls

    name = request.param
    runner, args = CONFIGS[name]
    folder = tmp_path_factory.mktemp(name)
    prompts = long_prompts_file if long_prompt_config(name) else prompts_file
    steps = record_steps(folder, prompts, "0:60", 10, args, runner, RECORD_ENV.get(name))
    extra = make_negative_controls(steps, folder / "controls")
    result = folder / "replays.jsonl"
    replay = tracekit("replay", steps, *extra.paths.values(), "--keep-going", "--iters", 20, "--samples", 5,
                      "--json", result, runner=runner)
    records = json_records(result) if result.exists() else {}
    return Recording(name, steps, replay, records, extra)
