"""Time to verdict: `tracekit replay BUNDLE` against vLLM starting the same engine and running one step.

Run by hand (not a test), on CPU:

    PYTHONPATH=$PWD .venv/bin/python tools/bench_time_to_verdict.py --rounds 3

and on the GPU machine (vLLM 0.26, the kit of tools/gpu_run.sh installed):

    source .gpu-kit/install.sh env && PYTHONPATH=$PWD python3 tools/bench_time_to_verdict.py \
        --rounds 3 --runner v2 --graphs --dtype bfloat16 [--preset llama-8b]

It records the built-in workload's first steps once (`tracekit record`, every step a bundle, with
torch.compile; `--graphs`: with vLLM's CUDA graphs of its default capture sizes, else none;
`--preset`: a model of that size, tools/bench_presets.py) and takes the last decode step (a FULL
graph where there are graphs), or `--bundle PATH`. Then, in
rounds whose order is rotated from round to round, each a fresh process, wall clock from its start
to its exit:

  lean          `tracekit replay BUNDLE --no-timing`: the lean engine, to the verdict
  full          the same with `--full-engine`: the engine as vLLM builds it
  vllm          `LLM(**the bundle's engine arguments)` and one `generate` step of one token
  vllm+cache    the same with the release's lean environment (vLLM at its fastest start here)

Every side leaves with `os._exit` once it has its answer (a replay does; vLLM's engine shutdown
and interpreter teardown are not part of starting it). One round before them, not counted, fills
the compile caches every variant would find on a machine that has replayed before. Engines run
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on every side. Prints each variant's median, the
ratios to vllm (target lean/vllm <= 0.5), and where each variant's time went: importing torch and
vLLM (the floor of any fresh process), building the engine, and the step with what follows it.
`--logs DIR` keeps each variant's last output (vLLM's INFO log: compile and capture times).
`--cold`: every run starts with empty compile caches (vLLM's, Inductor's, Triton's), as the first
replay of another team's bundle on this machine, or vLLM's first start of that engine, does; no
round fills them first.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_presets import PRESETS, preset_engine_args

VARIANTS = ("lean", "full", "vllm", "vllm+cache")
VLLM_ONE_STEP = """
import json, os, sys, time
started = time.perf_counter()
from vllm import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
built = time.perf_counter()
llm.generate(["The capital of France is"], SamplingParams(max_tokens=1), use_tqdm=False)
done = time.perf_counter()
print("PHASES " + json.dumps({"import vLLM": imported - started, "engine": built - imported, "step": done - built}))
sys.stdout.flush()
os._exit(0)
"""


def environment(runner: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0", **(extra or {})}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def cold_caches(folder: str) -> dict[str, str]:
    """Empty compile caches under `folder`: vLLM's (torch.compile artifacts), Inductor's, Triton's."""
    return {"VLLM_CACHE_ROOT": f"{folder}/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor",
            "TRITON_CACHE_DIR": f"{folder}/triton"}


def timed(argv: list[str], env: dict[str, str], log: Path | None = None) -> tuple[float, dict[str, float]]:
    """Wall seconds from start to exit, and where they went (seconds by phase; "other" is the
    rest: the interpreter, tracekit's and torch's imports, reading the bundle)."""
    with tempfile.TemporaryDirectory() as folder:
        json_out = Path(folder) / "replay.json"
        is_replay = "replay" in argv
        started = time.perf_counter()
        done = subprocess.run([*argv, "--json", str(json_out)] if is_replay else argv, env=env,
                              capture_output=True, text=True, timeout=1800)
        seconds = time.perf_counter() - started
        if log is not None:
            log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
        if done.returncode != 0:
            sys.exit(f"{' '.join(argv[:4])}... failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        if is_replay:
            phases = replay_phases(json.loads(json_out.read_text().splitlines()[0]))
        else:
            line = next((line for line in done.stdout.splitlines() if line.startswith("PHASES ")), None)
            phases = json.loads(line.removeprefix("PHASES ")) if line else {}
    return seconds, {**phases, "other": seconds - sum(phases.values())}


def replay_phases(record: dict) -> dict[str, float]:
    build = record.get("engine_build") or {}
    imports = build.get("import_seconds") or 0.0
    built = build.get("seconds") or 0.0
    return {"import vLLM": imports, "engine": built - imports, "step": record["seconds"] - built}


def record(folder: Path, options: argparse.Namespace) -> Path:
    """Record the workload's first steps; the last decode step (every request at one token), or
    the last step where none is."""
    from tracekit.format.content import load_step

    graphs = [] if options.graphs else ["--compilation-config", json.dumps({"cudagraph_mode": "NONE"})]
    engine_args = [f"--{name.replace('_', '-')}={json.dumps(value) if isinstance(value, dict) else value}"
                   for name, value in preset_engine_args(options.preset).items()]
    dtype = [] if engine_args else ["--dtype", options.dtype]
    argv = [sys.executable, "-m", "tracekit", "record", "-o", str(folder / "step{step}.zst"), "--steps", "0:12",
            "--max-tokens", "8", *dtype, *graphs, *engine_args]
    timed(argv, environment(options.runner))
    bundles = sorted(folder.glob("step*.zst"), key=lambda path: int(path.stem.removeprefix("step")))
    decodes = [path for path in bundles
               if all(request.num_scheduled_tokens == 1 and request.num_computed_tokens > 0
                      for request in load_step(path)[1].requests)]
    return (decodes or bundles)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1")
    parser.add_argument("--graphs", action="store_true", help="record with vLLM's CUDA graphs (a GPU)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="model shapes over the embedded tiny Llama (dummy weights unless tiny; its dtype)")
    parser.add_argument("--bundle", type=Path, default=None, help="time this bundle instead of recording one")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma list of the variants to time (vllm always among them: the ratios' base)")
    parser.add_argument("--logs", type=Path, default=None, help="keep each variant's last output in this folder")
    parser.add_argument("--cold", action="store_true", help="every run with empty compile caches (no warm-up round)")
    options = parser.parse_args()
    variants = tuple(v for v in VARIANTS if v in {*options.variants.split(","), "vllm"})

    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.releases.installed import installed_release
    from tracekit.integrations.vllm.replay_engine import replay_engine_args

    bundle = options.bundle or record(Path(tempfile.mkdtemp(prefix="tracekit-ttv-")), options)
    content, step = load_step(bundle)
    engine_args = replay_engine_args(content.engine, None, False, {})
    runner = content.engine.runner
    print(f"bundle {bundle}: step {step.index}, dispatched {step.graph.runtime_mode} at "
          f"{step.graph.num_tokens_padded} tokens; runner {runner}; vLLM {content.engine.vllm_version}")
    replay = [sys.executable, "-m", "tracekit", "replay", str(bundle), "--no-timing"]
    one_step = [sys.executable, "-c", VLLM_ONE_STEP, json.dumps(engine_args)]
    commands = {
        "lean": (replay, environment(runner)),
        "full": ([*replay, "--full-engine"], environment(runner)),
        "vllm": (one_step, environment(runner)),
        "vllm+cache": (one_step, environment(runner, installed_release().lean_env)),
    }
    if options.logs:
        options.logs.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    phases: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    warm_up = 0 if options.cold else 1  # a round, not counted, that fills the caches
    for round_index in range(warm_up + options.rounds):
        order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
        for variant in order:
            log = options.logs / f"{variant}.log" if options.logs else None
            argv, env = commands[variant]
            with tempfile.TemporaryDirectory(prefix="tracekit-ttv-cold-") as caches:
                seconds, where = timed(argv, {**env, **cold_caches(caches)} if options.cold else env, log=log)
            if round_index >= warm_up:
                times[variant].append(seconds)
                phases[variant].append(where)
        if round_index >= warm_up:
            print(f"round {round_index - warm_up + 1}: " + ", ".join(f"{v} {times[v][-1]:.1f} s" for v in variants),
                  flush=True)
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    print("median wall time, process start to exit: " + ", ".join(f"{v} {medians[v]:.1f} s" for v in variants))
    for variant in variants:
        names = list(phases[variant][0])
        print(f"  {variant}: " + ", ".join(
            f"{name} {statistics.median(where[name] for where in phases[variant]):.1f} s" for name in names))
    for variant in ("lean", "full"):
        if variant not in medians:
            continue
        cached = f", {variant}/vllm+cache {medians[variant] / medians['vllm+cache']:.2f}x" if "vllm+cache" in medians else ""
        print(f"{variant}/vllm {medians[variant] / medians['vllm']:.2f}x "
              f"(rounds {min(times[variant]) / max(times['vllm']):.2f}-{max(times[variant]) / min(times['vllm']):.2f}x)"
              + cached)
    vllm_phases = phases["vllm"]
    if vllm_phases and "import vLLM" in vllm_phases[0]:
        floor = statistics.median(where["import vLLM"] + where["other"] for where in vllm_phases)
        print(f"floor: a fresh process that imports torch and vLLM and builds nothing takes {floor:.1f} s, "
              f"{floor / medians['vllm']:.2f}x of vllm")


if __name__ == "__main__":
    main()
