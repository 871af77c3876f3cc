"""Time to verdict: `tracekit replay BUNDLE` against vLLM starting the same engine and running one step.

Run by hand (not a test), on CPU:

    PYTHONPATH=$PWD .venv/bin/python tools/bench_time_to_verdict.py --rounds 3

and on the GPU machine (vLLM 0.26, the kit of tools/gpu_run.sh installed):

    source .gpu-kit/install.sh env && PYTHONPATH=$PWD python3 tools/bench_time_to_verdict.py \
        --rounds 3 --runner v2 --graphs --dtype bfloat16

It records the built-in workload's first steps once (`tracekit record`, every step a bundle, with
torch.compile; `--graphs`: with vLLM's CUDA graphs of its default capture sizes, else none) and
takes the last step (a decode: a FULL graph where there are graphs), or `--bundle PATH`. Then, in
rounds whose order is rotated from round to round, each a fresh process, wall clock from its start
to its exit:

  lean          `tracekit replay BUNDLE --no-timing`: the lean engine, to the verdict
  full          the same with `--full-engine`: the engine as vLLM builds it
  vllm          `LLM(**the bundle's engine arguments)` and one `generate` step of one token
  vllm+cache    the same with the release's lean environment (vLLM at its fastest start here)

One round before them, not counted, fills the compile caches every variant would find on a
machine that has replayed before. Engines run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) on
every side. Prints each variant's median and the ratios to vllm; target lean/vllm <= 0.5.
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

VARIANTS = ("lean", "full", "vllm", "vllm+cache")
VLLM_ONE_STEP = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(**json.loads(sys.argv[1]))
llm.generate(["The capital of France is"], SamplingParams(max_tokens=1), use_tqdm=False)
"""


def environment(runner: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0", **(extra or {})}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])}... failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return seconds


def record(folder: Path, options: argparse.Namespace) -> Path:
    graphs = [] if options.graphs else ["--compilation-config", json.dumps({"cudagraph_mode": "NONE"})]
    argv = [sys.executable, "-m", "tracekit", "record", "-o", str(folder / "step{step}.zst"), "--steps", "0:6",
            "--max-tokens", "8", "--dtype", options.dtype, *graphs]
    timed(argv, environment(options.runner))
    return max(folder.glob("step*.zst"), key=lambda path: int(path.stem.removeprefix("step")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1")
    parser.add_argument("--graphs", action="store_true", help="record with vLLM's CUDA graphs (a GPU)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--bundle", type=Path, default=None, help="time this bundle instead of recording one")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma list of the variants to time (vllm always among them: the ratios' base)")
    options = parser.parse_args()
    variants = tuple(v for v in VARIANTS if v in {*options.variants.split(","), "vllm"})

    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.version import installed_release
    from tracekit.replay.engine import replay_engine_args

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
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for round_index in range(options.rounds + 1):
        order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
        for variant in order:
            seconds = timed(*commands[variant])
            if round_index:  # the first round fills the caches
                times[variant].append(seconds)
        if round_index:
            print(f"round {round_index}: " + ", ".join(f"{v} {times[v][-1]:.1f} s" for v in variants), flush=True)
    medians = {variant: statistics.median(values) for variant, values in times.items()}
    print("median wall time, process start to exit: " + ", ".join(f"{v} {medians[v]:.1f} s" for v in variants))
    for variant in ("lean", "full"):
        if variant not in medians:
            continue
        cached = f", {variant}/vllm+cache {medians[variant] / medians['vllm+cache']:.2f}x" if "vllm+cache" in medians else ""
        print(f"{variant}/vllm {medians[variant] / medians['vllm']:.2f}x "
              f"(rounds {min(times[variant]) / max(times['vllm']):.2f}-{max(times[variant]) / min(times['vllm']):.2f}x)"
              + cached)


if __name__ == "__main__":
    main()
