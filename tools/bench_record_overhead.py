"""What an armed recorder costs the engine it sits in.

Run by hand (not a test): `.venv/bin/python tools/bench_record_overhead.py [--rounds 5]`.

The engine runs the model runner vLLM picks (V1 on this CPU build); the environment chooses,
as for any engine: `VLLM_USE_V2_MODEL_RUNNER=0|1`. On a CPU without Triton, Model Runner V2 runs
only through the test harness (Triton's interpreter: steps are far slower than on a GPU, so keep
the run short):

    PYTHONPATH=$PWD:tests/harness/v2_on_cpu VLLM_USE_V2_MODEL_RUNNER=1 \
        .venv/bin/python tools/bench_record_overhead.py --rounds 3 --max-tokens 16

In one engine and one process, rounds of the same greedy workload, the variants' order rotated
from round to round:
  unarmed                  no recorder
  armed, waiting           a recorder whose step trigger never fires (the normal state)
  armed, copy every step   `--on exception`: every step's inputs and KV are copied to host
then one round in which every step fires (bundles written by the background thread), to show a
firing step's stall: its host copy, against the step's own time; and (eager) one more in which
every step fires with `layers=True`, its forward and bundle size against firing without.

Prints generate throughput (tokens/s, median over rounds), the ratios against unarmed, and the
same difference as time per engine step. Target: armed-and-waiting >= 0.99x.
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (default: eager)")
    options = parser.parse_args()

    from vllm import SamplingParams

    from tracekit.integrations.vllm.engine import adapter_of, build_llm
    from tracekit.models import tiny_model_path
    from tracekit.record.api import recording
    from tracekit.record.workload import DEFAULT_ENGINE_ARGS

    llm = build_llm({**DEFAULT_ENGINE_ARGS, "model": tiny_model_path(), "enforce_eager": not options.compile,
                     "max_num_batched_tokens": 512})
    prompts = [f"Request number {i} asks the engine about the weather in city {i}" for i in range(options.requests)]
    params = SamplingParams(max_tokens=options.max_tokens, temperature=0.0, ignore_eos=True)
    out_dir = tempfile.mkdtemp(prefix="tracekit-bench-")

    def generate() -> tuple[float, float]:
        """Tokens per wall second, and per second of this process's CPU time (the steadier
        figure on a shared machine: other processes' load does not count)."""
        started, started_cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, elapsed_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return tokens / elapsed, tokens / elapsed_cpu

    generate()  # warm-up
    variants = {
        "unarmed": lambda: None,
        "armed, waiting": lambda: recording(llm, f"{out_dir}/never{{step}}.zst", steps="1000000"),
        "armed, copy every step": lambda: recording(llm, f"{out_dir}/exc{{step}}.zst", on=("exception",)),
    }
    throughput: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    for round_number in range(options.rounds):
        # Rotate the order every round, so no variant always follows the same one.
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            arm = variants[name]
            context = arm()
            if context is None:
                throughput[name].append(generate())
            else:
                with context:
                    throughput[name].append(generate())

    def median(name: str, column: int) -> float:
        return statistics.median(values[column] for values in throughput[name])

    print(f"model runner {adapter_of(llm).kind.value}; median of {options.rounds} rounds (order rotated), "
          f"{options.requests} requests x {options.max_tokens} tokens")
    print(f"{'variant':24} {'tok/s wall':>11} {'vs unarmed':>11} {'tok/s CPU':>10} {'vs unarmed':>11}")
    for name in variants:
        wall, cpu = median(name, 0), median(name, 1)
        print(f"{name:24} {wall:11.1f} {wall / median('unarmed', 0):10.3f}x {cpu:10.1f} {cpu / median('unarmed', 1):10.3f}x")

    from tracekit.format import open_bundle
    from tracekit.format.schema import BundleContent

    def firing_round(name: str, layers: bool) -> dict[str, float]:
        """Every step fires; the medians of what its bundle says about the step, and its size."""
        with recording(llm, f"{out_dir}/{name}{{step}}.zst", steps="0:", max_bundles=1000, layers=layers) as recorder:
            generate()
        timings, sizes = [], []
        for path in recorder.written:
            with open_bundle(path) as reader:
                timings.append(BundleContent.from_plain(reader.metadata).steps[0].timing)
            sizes.append(os.path.getsize(path))
        return {
            "steps": len(timings),
            "copy": statistics.median(t.host_copy_us for t in timings),
            "forward": statistics.median(t.forward_us for t in timings),
            "step": statistics.median(t.step_us for t in timings),
            "bytes": statistics.median(sizes),
        }

    fired = firing_round("fire", layers=False)
    print(
        f"\nfiring steps: {fired['steps']}; host copy median {fired['copy']:.0f} us, "
        f"forward median {fired['forward']:.0f} us, step median {fired['step']:.0f} us "
        f"(the stall is the copy: {fired['copy'] / fired['step']:.1%} of a step); "
        f"compression and writing ran on the writer thread"
    )
    # The ratios hide a fixed per-step cost behind a slow step (Model Runner V2 in Triton's
    # interpreter): the same medians as time per engine step.
    tokens = options.requests * options.max_tokens
    for name in names[1:]:
        wall, cpu = (1e6 * tokens * (1 / median(name, c) - 1 / median("unarmed", c)) / fired["steps"] for c in (0, 1))
        print(f"{name}: {wall:+.0f} us wall, {cpu:+.0f} us CPU per step against unarmed")

    if not options.compile:  # per-layer outputs are captured from eager engines only
        layered = firing_round("layers", layers=True)
        print(
            f"firing steps with --layers: forward median {layered['forward']:.0f} us "
            f"({layered['forward'] / fired['forward']:.2f}x of firing without; the hooks copy every layer's "
            f"output to host inside the forward), bundle median {layered['bytes'] / 1024:.0f} KiB "
            f"({layered['bytes'] / fired['bytes']:.2f}x)"
        )

if __name__ == "__main__":
    main()
