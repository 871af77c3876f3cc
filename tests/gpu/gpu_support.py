"""Running real vLLM engines (0.26 or 0.34) on a CUDA machine for the GPU tests, and reading what
they wrote.

Every engine runs in a fresh process (`python -m tracekit ...`, or an engine script), as on the
CPU; the GPU machine has no console script, only the checkout on PYTHONPATH (`tools/gpu_run.sh`).
What an engine did is read back from the bundles and the `--json` records it left.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

E2E = Path(__file__).resolve().parents[1] / "e2e"
sys.path.insert(0, str(E2E))  # the step kinds and bundle readers the CPU end-to-end tests use

from e2e_support import (  # noqa: E402,F401
    Finished,
    bundles_by_step,
    long_context_decode,
    of_kind,
    read_content,
    read_step,
    sampling,
)
from features_support import checks_by_item, flip_one_allowed_token, grammar_kinds, make_adapter  # noqa: E402,F401

ENGINE_TIMEOUT_S = 600


def _installed_release():
    """The installed vLLM's release support (None without a supported vLLM: then every GPU test
    is skipped anyway)."""
    from tracekit.errors import TracekitError
    from tracekit.integrations.vllm.releases.installed import installed_release

    try:
        return installed_release()
    except TracekitError:
        return None


_RELEASE = _installed_release()
INSTALLED_SERIES = None if _RELEASE is None else ".".join(_RELEASE.version.split(".")[:2])
# Whether this vLLM has Model Runner V1 (0.34 removed it): the V1 configurations skip otherwise.
HAS_V1 = _RELEASE is not None and any(adapter.kind == "v1" for adapter in _RELEASE.adapters)
# The runner every single-runner test uses: V1 where there is one (as these tests were first run
# on 0.26), else V2.
DEFAULT_RUNNER = "v1" if HAS_V1 else "v2"
# Capture sizes up to the workload's token budget (64): decode steps replay FULL graphs (of a
# padded size), mixed steps PIECEWISE graphs.
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64]
GRAPHS = ["--compilation-config", json.dumps({"cudagraph_capture_sizes": CAPTURE_SIZES})]


def gpu_env(runner: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", **(extra or {})}
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    return env


def run(argv: list[str], runner: str = "v2", timeout: float = ENGINE_TIMEOUT_S, env: dict[str, str] | None = None
        ) -> Finished:
    started = time.perf_counter()
    done = subprocess.run(argv, env=gpu_env(runner, env), capture_output=True, text=True, timeout=timeout)
    return Finished(done.returncode, done.stdout, done.stderr, time.perf_counter() - started)


# Where set (`TRACEKIT_GPU_PROBE=1 bash tools/gpu_run.sh ...`), every tracekit process runs under
# tools/probe_compiled_code.py and leaves its manifest of what its compiled steps ran with in a
# numbered folder here, listed with its command in `commands.txt`: the processes of a run that
# parts (issue 28's float32 recordings) can then be compared with their replays'.
PROBE_DIR = os.environ.get("TRACEKIT_GPU_PROBE_DIR")
PROBE_TOOL = Path(__file__).resolve().parents[2] / "tools" / "probe_compiled_code.py"


def tracekit(*args: Any, runner: str = "v2", env: dict[str, str] | None = None) -> Finished:
    argv = list(map(str, args))
    return run([sys.executable, *_started_as(argv, runner), *argv], runner, env=env)


def _started_as(argv: list[str], runner: str) -> list[str]:
    """How a tracekit process is started: as a module, or under the probe (a folder of its own,
    numbered in the order the processes ran)."""
    if not PROBE_DIR:
        return ["-m", "tracekit"]
    folder = Path(PROBE_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / f"{len(list(folder.glob('[0-9]*'))):03d}"
    manifest.mkdir()
    with open(folder / "commands.txt", "a") as commands:
        commands.write(f"{manifest.name} {runner} {' '.join(argv)}\n")
    return [str(PROBE_TOOL), str(manifest), "--"]


def record_steps(folder: Path, prompts_file: Path, steps: str, max_tokens: int, engine_args: list[str],
                 runner: str, env: dict[str, str] | None = None) -> Path:
    """Record every step in `steps` of the prompts into `folder`/steps (one bundle a step)."""
    out = folder / "steps"
    out.mkdir()
    record = tracekit("record", "-o", out / "step{step}.zst", "--steps", steps, "--prompts", prompts_file,
                      "--max-tokens", max_tokens, *engine_args, runner=runner, env=env)
    assert record.returncode == 0, record.explain()
    return out


def json_records(path: Path) -> dict[str, dict[str, Any]]:
    """The `--json` records of a replay, by bundle path."""
    return {record["bundle"]: record for record in map(json.loads, path.read_text().splitlines())}


def checks_of(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["item"]: check for check in record["checks"]}


MODELS = Path(__file__).resolve().parents[1] / "models"


def tiny_sizes() -> list[str]:
    """The embedded model's engine sizes, for a tiny model named by path: a model the user names
    gets vLLM's own defaults (a KV cache of most of the device, a token budget that chunks none of
    the workload), which would neither chunk nor leave room for another engine beside it."""
    from tracekit.record.workload import EMBEDDED_MODEL_ENGINE_ARGS as sizes

    return ["--max-num-batched-tokens", str(sizes["max_num_batched_tokens"]), "--max-num-seqs",
            str(sizes["max_num_seqs"]), "--kv-cache-memory-bytes", str(sizes["kv_cache_memory_bytes"])]


def tiny_config(name: str) -> list[str]:
    """A second architecture shipped as a config alone (tests/models/NAME), its weights random
    (`dummy`), with the embedded model's tokenizer and engine sizes."""
    from tracekit.models import tiny_model_path

    return ["--model", str(MODELS / name), "--tokenizer", tiny_model_path(), "--load-format", "dummy", *tiny_sizes()]


# Budgets of 512 tokens need a prompt long enough to be chunked at them (`LONG_PROMPT`).
LONG = ["--max-model-len", "2048"]

# Engine configurations, each recorded once and replayed in one process: (runner, engine args).
CONFIGS = {
    # vLLM's defaults on an H200 (0.26 and 0.34): Model Runner V2, FULL_AND_PIECEWISE graphs, async
    # scheduling; the capture sizes those of the workload's token budget.
    "v2-bf16-graphs": ("v2", ["--dtype", "bfloat16", *GRAPHS]),
    # Nothing but the dtype set: the capture sizes vLLM picks itself (0.34: prefill graphs by
    # tokens, decode graphs by requests).
    "v2-bf16-defaults": ("v2", ["--dtype", "bfloat16"]),
    "v1-bf16-graphs": ("v1", ["--dtype", "bfloat16", *GRAPHS]),
    "v1-bf16-graphs-sync": ("v1", ["--dtype", "bfloat16", "--no-async-scheduling", *GRAPHS]),
    "v2-fp32-graphs": ("v2", ["--dtype", "float32", *GRAPHS]),
    "v2-bf16-eager": ("v2", ["--dtype", "bfloat16", "--enforce-eager"]),
    "v1-fp32-eager": ("v1", ["--dtype", "float32", "--enforce-eager"]),
    # vLLM's own capture sizes, and budgets whose prefill chunks run compiled without a graph
    # or as PIECEWISE graphs of larger sizes.
    "v2-bf16-defaults-128": ("v2", ["--dtype", "bfloat16", "--max-num-batched-tokens", "128"]),
    "v1-bf16-defaults-128": ("v1", ["--dtype", "bfloat16", "--max-num-batched-tokens", "128"]),
    "v2-bf16-defaults-512": ("v2", ["--dtype", "bfloat16", "--max-num-batched-tokens", "512", *LONG]),
    "v1-bf16-defaults-512": ("v1", ["--dtype", "bfloat16", "--max-num-batched-tokens", "512", *LONG]),
    "v2-fp32-defaults-512": ("v2", ["--dtype", "float32", "--max-num-batched-tokens", "512", *LONG]),
    # float32 on V1 too (the quick run records float32 on V2 alone)
    "v1-fp32-defaults-128": ("v1", ["--dtype", "float32", "--max-num-batched-tokens", "128"]),
    "v1-fp32-defaults-512": ("v1", ["--dtype", "float32", "--max-num-batched-tokens", "512", *LONG]),
    # A second architecture and an MoE, and an fp8 KV cache.
    "v2-qwen2-bf16-graphs": ("v2", [*tiny_config("tiny-qwen2"), "--dtype", "bfloat16", *GRAPHS]),
    "v2-mixtral-bf16-graphs": ("v2", [*tiny_config("tiny-mixtral"), "--dtype", "bfloat16", *GRAPHS]),
    "v2-bf16-fp8kv-graphs": ("v2", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8", *GRAPHS]),
}
# Environment of the recording engine only: the replay takes it from the bundle. (The float32
# compiled configurations record without Inductor's deterministic mode: each process then picks
# some kernel configs by timing them, and the bundle carries the choices for the replay.)
RECORD_ENV: dict[str, dict[str, str]] = {}


# EAGLE drafting with the tiny draft config of tests/models (a config alone: dummy weights).
TINY_EAGLE = {"method": "eagle", "model": str(MODELS / "tiny-eagle-llama"), "num_speculative_tokens": 3,
              "draft_load_config": {"load_format": "dummy"}}


MTP = {"method": "mtp", "num_speculative_tokens": 3}  # the target's own MTP layer, run three times
MAKE_TINY_MTP = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_mtp.py"


def tiny_mtp_target(folder: Path) -> list[str]:
    """MTP drafts from layers of the target's own checkpoint: the one the project's tool makes
    (the embedded model's real weights and a seeded MTP layer), in `folder`."""
    done = subprocess.run([sys.executable, str(MAKE_TINY_MTP), str(folder / "tiny-mimo-mtp")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ["--model", str(folder / "tiny-mimo-mtp"), *tiny_sizes()]


def speculative_args(runner: str, config: dict[str, Any]) -> list[str]:
    """`--speculative-config CONFIG`; for a drafter of dummy weights on Model Runner V2, the
    target's weights dummy too: vLLM 0.26's V2 loads a drafter with the target's load config (its
    `draft_load_config` unread) and finds no weights in a folder holding a config alone."""
    args = ["--speculative-config", json.dumps(config)]
    if runner == "v2" and config.get("draft_load_config", {}).get("load_format") == "dummy":
        args += ["--load-format", "dummy"]
    return args


def long_prompt_config(name: str) -> bool:
    return "--max-model-len" in CONFIGS[name][1]

