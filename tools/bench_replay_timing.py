"""How close a replay's timed forward comes to the same forward in the engine that recorded it.

The recorder times the engine's model call as the device's own time (its start event queued
behind a spin longer than the host's issue: tracekit.graphs.timing.RegionTimer); the replay times
the same call, in the same mode (for a decode step: the same FULL CUDA graph of the same padded
size), the same way. This records the decode steps of the built-in workload on the default GPU
engine (Model Runner V2, FULL_AND_PIECEWISE graphs, async scheduling), replays each in a fresh
process with many timed runs, and prints replay / recorded per step. Target (not a test): within
±5% for FULL-graph steps, sample spread under 2%.

    python tools/bench_replay_timing.py [--runner v2|v1] [--dtype bfloat16] [--iters 50] [--samples 5]

On CPU it runs too (eager engines, host clock), where the target does not apply.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--steps", default="0:40")
    options = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "1" if options.runner == "v2" else "0"}
    work = Path(tempfile.mkdtemp(prefix="tracekit-timing-"))
    capture = json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})
    record = [sys.executable, "-m", "tracekit", "record", "-o", str(work / "step{step}.zst"), "--steps", options.steps,
              "--when", "num_prefills==0", "--dtype", options.dtype, "--compilation-config", capture]
    subprocess.run(record, env=env, check=True, capture_output=True)
    records = work / "replays.jsonl"
    subprocess.run([sys.executable, "-m", "tracekit", "replay", str(work), "--keep-going", "--iters", str(options.iters),
                    "--samples", str(options.samples), "--json", str(records)], env=env, capture_output=True)
    print(f"{'step':>5} {'mode':>9} {'rows':>9} {'recorded us':>12} {'replay us':>10} {'ratio':>7} {'spread':>7}  verdict")
    ratios = []
    for line in records.read_text().splitlines():
        record = json.loads(line)
        timed = record["modes"].get(record["reference_mode"], {})
        if not timed.get("available"):
            continue
        dispatch = record["dispatch"]["recorded"]
        latency = timed["latency_us"]
        ratio = timed.get("ratio_to_recorded")
        if dispatch["runtime_mode"] == "FULL" and ratio:
            ratios.append(ratio)
        print(f"{record['step']:>5} {dispatch['runtime_mode']:>9} {dispatch['num_tokens']:>4}->{dispatch['num_tokens_padded']:<4}"
              f" {record['recorded']['forward_us']:12.1f} {latency['median']:10.1f} {ratio:7.3f}"
              f" {latency['sample_spread_pct']:6.2f}%  {record['verdict']}")
    if ratios:
        ratios.sort()
        print(f"FULL-graph steps: {len(ratios)}, replay/recorded median {ratios[len(ratios) // 2]:.3f} "
              f"(range {ratios[0]:.3f}..{ratios[-1]:.3f}); target 0.95..1.05")


if __name__ == "__main__":
    main()
