"""What recording a window of steps costs (`record --window N`, issue 32), against recording the
same steps as single-step bundles.

Run by hand (not a test). On this CPU (the embedded tiny model):

    .venv/bin/python tools/bench_window.py --rounds 3

In one engine and one process, rounds of the same greedy workload (a long prompt prefilled in
chunks beside short ones that decode), the variants' order rotated from round to round:
  unarmed   no recorder
  singles   every step of the window's range recorded as its own bundle (`--steps A:B`)
  window    the same steps as one window (`--steps A --window B-A`)
Printed, medians over rounds:
  * the recorder's own time per step (every callback the engine makes into it, the copies to host
    and the serialising of vLLM objects included): a window's later step against a single-step
    bundle's step, and the window's first step (copied whole, as a single step is);
  * `timing.host_copy_us` as the bundles record it, the same way round;
  * the engine's tokens per second against unarmed (the writer thread compresses on the same
    cores: on a 2-core machine it shows);
  * bytes: the window, the single-step bundle of its first step, the bytes each later step adds
    ((window - first single) / (N - 1)) against a single-step bundle of a later step (median).
Target: a later step of a window holds only deltas and outputs (no KV, no per-request tokens), so
it costs a fraction of a single-step bundle in recorder time and bytes.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_record_overhead import _time_callbacks

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first", type=int, default=2, help="the window's first step")
    parser.add_argument("--length", type=int, default=8, help="steps in the window")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="torch.compile as vLLM defaults (default: eager)")
    parser.add_argument("--json", default=None, help="also write the results here")
    options = parser.parse_args()

    from vllm import SamplingParams

    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.engines.build import adapter_of, build_llm
    from tracekit.models import tiny_model_path
    from tracekit.record.api import recording
    from tracekit.record.workload import BUILTIN_WORKLOAD, EMBEDDED_MODEL_ENGINE_ARGS

    llm = build_llm({**EMBEDDED_MODEL_ENGINE_ARGS, "model": tiny_model_path(), "enforce_eager": not options.compile})
    adapter = adapter_of(llm)
    prompts = [request.prompt for request in BUILTIN_WORKLOAD]
    params = SamplingParams(max_tokens=options.max_tokens, temperature=0.0, ignore_eos=True)
    first, last = options.first, options.first + options.length  # steps [first, last)

    def generate() -> float:
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)

    generate()  # warm-up
    variants = {
        "unarmed": lambda folder: None,
        "singles": lambda folder: recording(llm, f"{folder}/step{{step}}.zst", steps=f"{first}:{last}", max_bundles=1000),
        "window": lambda folder: recording(llm, f"{folder}/window.zst", steps=str(first), window=options.length),
    }
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for number in range(options.rounds):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            folder = tempfile.mkdtemp(prefix=f"tracekit-bench-window-{name}-")
            context = variants[name](folder)
            if context is None:
                rounds[name].append({"tokens_per_s": generate()})
                continue
            per_step: dict[int, float] = {}
            with context as recorder:
                _time_callbacks(recorder, per_step)
                tokens_per_s = generate()
            if recorder.failures or not recorder.written:
                raise SystemExit(f"{name}: wrote {recorder.written}, failed {recorder.failures}")
            rounds[name].append({"tokens_per_s": tokens_per_s, "in_recorder_us": per_step,
                                 **_bundles(load_step, recorder.written, first, last)})

    results = _summary(rounds, first, last)
    results.update(runner=adapter.kind.value, device=adapter.device_backend.name, rounds=options.rounds,
                   compiled=options.compile, window=[first, last - 1])
    _print(results)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


def _bundles(load_step, written: list[Path], first: int, last: int) -> dict:
    """Bytes and recorded host-copy time per step of what a variant wrote."""
    sizes, host_copy = {}, {}
    for path in written:
        _, step = load_step(path)
        sizes[step.index] = path.stat().st_size
        host_copy[step.index] = step.timing.host_copy_us
        for carried in step.later:
            host_copy[carried.index] = carried.timing.host_copy_us
    return {"bytes": sizes, "host_copy_us": host_copy}


def _summary(rounds: dict[str, list[dict]], first: int, last: int) -> dict:
    median = statistics.median
    unarmed = median(r["tokens_per_s"] for r in rounds["unarmed"])
    later = range(first + 1, last)

    def per_step(name: str, key: str, steps) -> float:
        return median(median(r[key][index] for index in steps if index in r[key]) for r in rounds[name])

    window_bytes = median(r["bytes"][first] for r in rounds["window"])
    first_single = median(r["bytes"][first] for r in rounds["singles"])
    later_single = median(median(r["bytes"][index] for index in later) for r in rounds["singles"])
    extra = (window_bytes - first_single) / (last - first - 1)
    return {
        "tokens_per_s_vs_unarmed": {name: median(r["tokens_per_s"] for r in rounds[name]) / unarmed for name in rounds},
        "in_recorder_us": {
            "single_step": per_step("singles", "in_recorder_us", later),
            "window_first_step": per_step("window", "in_recorder_us", [first]),
            "window_later_step": per_step("window", "in_recorder_us", later),
        },
        "host_copy_us": {
            "single_step": per_step("singles", "host_copy_us", later),
            "window_later_step": per_step("window", "host_copy_us", later),
        },
        "bytes": {"window": window_bytes, "single_first_step": first_single, "single_later_step": later_single,
                  "per_extra_window_step": extra},
    }


def _print(results: dict) -> None:
    first, last = results["window"]
    recorder, copy, sizes = results["in_recorder_us"], results["host_copy_us"], results["bytes"]
    print(f"model runner {results['runner']} on {results['device']}, window of steps {first}..{last}, "
          f"median of {results['rounds']} rounds (order rotated)")
    print(f"recorder time per step: single-step bundle {recorder['single_step']:.0f} us, window's first step "
          f"{recorder['window_first_step']:.0f} us, window's later step {recorder['window_later_step']:.0f} us: "
          f"{recorder['window_later_step'] / recorder['single_step']:.2f}x a single step's")
    print(f"host copy per step (as recorded): single {copy['single_step']:.0f} us, window later step "
          f"{copy['window_later_step']:.0f} us: {copy['window_later_step'] / copy['single_step']:.2f}x")
    print("tokens/s against unarmed: " + ", ".join(f"{name} {ratio:.3f}x"
                                                   for name, ratio in results["tokens_per_s_vs_unarmed"].items()))
    print(f"bytes: window {sizes['window']:.0f}, single-step bundle of its first step {sizes['single_first_step']:.0f}; "
          f"each later step adds {sizes['per_extra_window_step']:.0f} against {sizes['single_later_step']:.0f} for a "
          f"single-step bundle of it: {sizes['per_extra_window_step'] / sizes['single_later_step']:.2f}x")


if __name__ == "__main__":
    main()
