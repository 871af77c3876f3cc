"""What an armed recorder costs the engine it sits in, and what a firing step stalls it for.

Run by hand (not a test). On this CPU (the embedded tiny model):

    .venv/bin/python tools/bench_record_overhead.py --rounds 5

On a GPU, a model large enough that KV copies show (dummy weights from a config, no model hub:
`--preset llama-8b` is the embedded model's tokenizer with Llama-3-8B's shapes):

    python3 tools/bench_record_overhead.py --preset llama-8b --rounds 5 --requests 32 \\
        --prompt-words 300 --max-tokens 64 --max-fired 4 [--compile]

The engine runs the model runner vLLM picks (`VLLM_USE_V2_MODEL_RUNNER=0|1` chooses; on a CPU
without Triton V2 runs only through the test harness, `PYTHONPATH=$PWD:tests/harness/v2_on_cpu`).

In one engine and one process, rounds of the same greedy workload, the variants' order rotated
from round to round:
  unarmed          no recorder
  armed, waiting   a recorder whose step trigger never fires (the normal state of `--steps`)
  always-on        `--on exception,nonfinite`: each step leaves a mark, checks its outputs on
                   the device, and copies nothing unless it fails
Then the firing stall, in two more rounds with every forward's hidden states poisoned by a NaN
(the engine's tokens are garbage; it does not matter): armed `--on exception` (never fires) and
armed `--on nonfinite` (every step fires and is written). Their difference per step is what a
firing step stalls the engine for; beside it, the host copy each bundle records
(`timing.host_copy_us`: the recorder's own copying; on a GPU through pinned memory on a side
stream). Target: always-on >= 0.98x unarmed; stall <= 1.1x the host copy.

Prints tokens/s (wall, and per second of this process's CPU time: steadier on a shared machine),
the medians over rounds, the ratios against unarmed, and the same differences as time per step.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

from bench_presets import PRESETS, preset_engine_args

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=12, help="words per prompt (more: more KV read per step)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="model shapes over the embedded tiny Llama, dummy weights unless tiny")
    parser.add_argument("--hf-overrides", default=None, help="JSON: more config overrides, over the preset's")
    parser.add_argument("--engine-args", default=None, help='JSON: more vLLM engine arguments, e.g. {"dtype": "bfloat16"}')
    parser.add_argument("--compile", action="store_true", help="torch.compile / CUDA graphs as vLLM defaults (default: eager)")
    parser.add_argument("--max-fired", type=int, default=0,
                        help="firing rounds: at most this many steps fire per round (0: every step; on a GPU with a "
                             "large KV, a few: each writes a bundle of every block its step read)")
    parser.add_argument("--json", default=None, help="also write the results here")
    options = parser.parse_args()

    from vllm import SamplingParams

    from tracekit.integrations.vllm.engines.build import adapter_of, build_llm
    from tracekit.models import tiny_model_path
    from tracekit.record.api import recording
    from tracekit.record.workload import EMBEDDED_MODEL_ENGINE_ARGS

    engine_args = {**EMBEDDED_MODEL_ENGINE_ARGS, "model": tiny_model_path(), "enforce_eager": not options.compile,
                   "max_num_batched_tokens": 512,
                   **preset_engine_args(options.preset, json.loads(options.hf_overrides or "{}"))}
    overrides = engine_args.get("hf_overrides", {})
    engine_args.update(json.loads(options.engine_args or "{}"))
    llm = build_llm(engine_args)
    adapter = adapter_of(llm)
    filler = " ".join(["weather"] * max(options.prompt_words - 8, 0))
    prompts = [f"Request number {i} asks the engine about the {filler} in city {i}" for i in range(options.requests)]
    params = SamplingParams(max_tokens=options.max_tokens, temperature=0.0, ignore_eos=True)
    out_dir = tempfile.mkdtemp(prefix="tracekit-bench-")
    backend = adapter.device_backend

    def generate() -> tuple[float, float]:
        """Tokens per wall second, and per second of this process's CPU time."""
        llm.reset_prefix_cache()
        backend.synchronize()
        started, started_cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        backend.synchronize()
        elapsed, elapsed_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return tokens / elapsed, tokens / elapsed_cpu

    generate()  # warm-up
    variants = {
        "unarmed": lambda: None,
        "armed, waiting": lambda: recording(llm, f"{out_dir}/never{{step}}.zst", steps="100000000"),
        "always-on": lambda: recording(llm, f"{out_dir}/on{{step}}.zst", on=("exception", "nonfinite")),
    }
    throughput: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    inside: dict[str, list[float]] = {name: [] for name in variants}  # us per step in the recorder's callbacks
    names = list(variants)
    steps_per_round = 0
    for round_number in range(options.rounds):
        shift = round_number % len(names)  # rotated: no variant always follows the same one
        for name in names[shift:] + names[:shift]:
            context = variants[name]()
            if context is None:
                throughput[name].append(generate())
                continue
            with context as recorder:
                spent = _time_callbacks(recorder)
                throughput[name].append(generate())
            steps_per_round = recorder.steps_seen
            inside[name].append(sum(spent.values()) / max(recorder.steps_seen, 1))
            if recorder.written or recorder.failures:
                raise SystemExit(f"{name} wrote {recorder.written} / failed {recorder.failures}: not a clean run")

    def median(name: str, column: int) -> float:
        return statistics.median(values[column] for values in throughput[name])

    def best(name: str) -> float:  # the round least slowed by anything else on the machine
        return max(values[0] for values in throughput[name])

    results: dict[str, object] = {
        "runner": adapter.kind.value, "device": backend.name, "preset": options.preset, "overrides": overrides,
        "rounds": options.rounds, "requests": options.requests, "max_tokens": options.max_tokens,
        "steps_per_round": steps_per_round, "variants": {},
    }
    print(f"model runner {adapter.kind.value} on {backend.name}, preset {options.preset}; median of {options.rounds} "
          f"rounds (order rotated), {options.requests} requests x {options.max_tokens} tokens, "
          f"{steps_per_round} steps per round")
    print(f"{'variant':16} {'tok/s wall':>11} {'vs unarmed':>11} {'tok/s CPU':>10} {'vs unarmed':>11} "
          f"{'best round':>11} {'vs unarmed':>11} {'in recorder':>12}")
    tokens = options.requests * options.max_tokens
    unarmed_step_us = 1e6 * tokens / best("unarmed") / max(steps_per_round, 1)
    for name in variants:
        wall, cpu = median(name, 0), median(name, 1)
        spent = statistics.median(inside[name]) if inside[name] else 0.0
        results["variants"][name] = {"tokens_per_s": wall, "vs_unarmed": wall / median("unarmed", 0),
                                     "cpu_tokens_per_s": cpu, "cpu_vs_unarmed": cpu / median("unarmed", 1),
                                     "best_tokens_per_s": best(name), "best_vs_unarmed": best(name) / best("unarmed"),
                                     "recorder_us_per_step": spent, "rounds": throughput[name]}
        print(f"{name:16} {wall:11.1f} {wall / median('unarmed', 0):10.3f}x {cpu:10.1f} "
              f"{cpu / median('unarmed', 1):10.3f}x {best(name):11.1f} {best(name) / best('unarmed'):10.3f}x "
              f"{spent:9.0f} us")
    results["unarmed_step_us"] = unarmed_step_us
    on = results["variants"]["always-on"]["recorder_us_per_step"]
    print(f"an unarmed step: {unarmed_step_us:.0f} us (best round); always-on spends {on:.0f} us of it in the "
          f"recorder's callbacks: {on / unarmed_step_us:.1%} (the engine's shadowed methods around them: "
          f"armed, waiting)")

    if options.compile:  # a graph replay never calls the model's forward, where the NaN is put
        print("\nfiring stall: measured on eager engines only (run again without --compile)")
        _write(options.json, results)
        return
    results["firing"] = firing_stall(llm, adapter, generate, tokens, out_dir, options.rounds, options.max_fired)
    fired = results["firing"]
    print(
        f"\nfiring (every step's hidden states poisoned; best of {fired['rounds']} round pairs): "
        f"{fired['steps']} steps fired, a step {fired['waiting_step_us']:.0f} us armed and not firing, "
        f"{fired['firing_step_us']:.0f} us firing: stall {fired['stall_us']:.0f} us per firing step against a host copy of "
        f"{fired['host_copy_us']:.0f} us ({fired['stall_vs_copy']:.2f}x the copy; {fired['copy_mib']:.2f} MiB of KV "
        f"per step); in the recorder's callbacks {fired['recorder_us']:.0f} us more per step than not firing "
        f"({fired['recorder_vs_copy']:.2f}x the copy; the rest: the writer thread's share of the machine)\n"
        f"each firing step's own time in the recorder (beyond a quiet step's) against its own host copy: median "
        f"{fired['stall_vs_own_copy_median']:.2f}x, p90 {fired['stall_vs_own_copy_p90']:.2f}x (target <= 1.10x); "
        f"in the engine thread's own CPU time {fired['stall_cpu_vs_own_copy_median']:.2f}x (the rest of the wall time: "
        f"waiting for the GIL or a core, held by the writer thread or the machine's other work)"
    )
    _write(options.json, results)


def _write(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(results, handle, indent=1)


# The recorder's callbacks from inside the engine's step (`StepObserver`).
CALLBACKS = ("step_started", "idle_step", "before_forward", "after_forward", "logits_computed", "phase_entered",
             "sampling", "output_receiver", "step_failed")


def _time_callbacks(recorder, per_step: dict[int, float] | None = None) -> dict[str, float]:
    """Time every callback the engine makes into `recorder` (us, summed), for this session; and
    into `per_step`, by step index, with the sampled ids' receipt too (a step's capture's `_end`,
    timed for this recorder's captures only)."""
    from tracekit.record.capture_kinds import StepCapture

    spent = dict.fromkeys(CALLBACKS, 0.0)

    def timed(method, name):
        def call(*args):
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args)
            finally:
                took = (time.perf_counter() - started) * 1e6
                spent[name] = spent.get(name, 0.0) + took
                if per_step is not None:
                    step = recorder.steps_seen - 1
                    per_step[step] = per_step.get(step, 0.0) + took
                    # the engine thread's own CPU time in it (not waiting for the GIL or a core)
                    per_step[-1 - step] = per_step.get(-1 - step, 0.0) + (time.thread_time() - started_cpu) * 1e6

        return call

    for name in CALLBACKS:
        setattr(recorder, name, timed(getattr(recorder, name), name))
    if per_step is not None:
        end = StepCapture._end

        def end_step(capture, *args):
            if capture.recorder is not recorder:
                return end(capture, *args)
            return timed(lambda *rest: end(capture, *rest), "end_step")(*args)

        StepCapture._end = end_step
    return spent


def firing_stall(llm, adapter, generate, tokens: int, out_dir: str, rounds: int, max_fired: int = 0) -> dict[str, float]:
    """Rounds with a NaN in every forward's hidden states, armed `--on exception` (never fires)
    and `--on nonfinite` (every step fires), alternated; per step: the difference, and the host
    copy the bundles record."""
    from tracekit.format.content import load_step
    from tracekit.record.api import recording

    model = adapter.runner.model
    original = model.forward

    def poisoned(*args, **kwargs):
        output = original(*args, **kwargs)
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[0, 0] = float("nan")
        return output

    step_us: dict[str, list[float]] = {"waiting": [], "firing": []}
    inside: dict[str, list[float]] = {"waiting": [], "firing": []}
    written, marks, marks_cpu, steps, fired_per_round = [], [], [], 0, 0
    model.forward = poisoned
    try:
        for round_number in range(rounds):
            order = [("waiting", ("exception",)), ("firing", ("nonfinite",))]
            for name, events in order if round_number % 2 == 0 else order[::-1]:
                folder = f"{out_dir}/{name}{round_number}"
                os.makedirs(folder)
                per_step: dict[int, float] = {}
                with recording(llm, f"{folder}/step{{step}}.zst", on=events, max_bundles=max_fired or 100000) as recorder:
                    spent = _time_callbacks(recorder, per_step)
                    wall, _ = generate()
                steps = recorder.steps_seen
                # the round's time per step; per firing step, below (the firing round's extra time
                # over the steps that fired)
                step_us[name].append(1e6 * tokens / wall / steps)
                fired_per_round = max(recorder.bundles_fired, fired_per_round) if name == "firing" else fired_per_round
                inside[name].append(sum(spent.values()) / steps)
                if name == "firing":
                    written.extend((path, per_step) for path in recorder.written)
                else:
                    marks.extend(us for step, us in per_step.items() if step >= 0)
                    marks_cpu.extend(us for step, us in per_step.items() if step < 0)
    finally:
        model.__dict__.pop("forward", None)
    copies, sizes, paired, paired_cpu = [], [], [], []
    mark_us = statistics.median(marks)  # what a step that does not fire spends in the recorder
    for path, per_step in written:
        _, step = load_step(path, None)
        copy = step.timing.host_copy_us + (step.timing.device_copy_us or 0.0)  # GPU: + the side stream
        copies.append(copy)
        sizes.append(sum(t.numel() * t.element_size() for group in step.kv.groups for t in group.before.values()))
        # this step's time in the recorder beyond a step's that does not fire, against its copy
        paired.append((per_step.get(step.index, 0.0) - mark_us) / copy)
        paired_cpu.append((per_step.get(-1 - step.index, 0.0) - statistics.median(marks_cpu)) / copy)
    paired.sort()
    paired_cpu.sort()
    waiting, firing = min(step_us["waiting"]), min(step_us["firing"])  # best rounds: least disturbed
    stall = (firing - waiting) * steps / max(fired_per_round, 1)  # per step that fired
    copy = statistics.mean(copies)
    in_recorder = statistics.median(inside["firing"]) - statistics.median(inside["waiting"])
    return {
        "rounds": rounds, "steps": len(written), "waiting_step_us": waiting, "firing_step_us": firing,
        "stall_us": stall, "host_copy_us": copy, "stall_vs_copy": stall / copy,
        "recorder_us": in_recorder, "recorder_vs_copy": in_recorder / copy,
        "stall_vs_own_copy_median": statistics.median(paired), "stall_vs_own_copy_p90": paired[int(0.9 * (len(paired) - 1))],
        "stall_cpu_vs_own_copy_median": statistics.median(paired_cpu),
        "copy_mib": statistics.mean(sizes) / 2**20, "per_round_us": step_us,
    }


if __name__ == "__main__":
    main()
