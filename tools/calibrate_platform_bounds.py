"""Measure how far a replay on another CPU ISA drifts from the recording, per dtype, to calibrate
the `platform_difference` bounds in `tracekit.numerics.PLATFORM_BOUNDS` (see docs/VERDICTS.md).

On an AVX512 machine the AVX2 side runs vLLM's and torch's real AVX2 kernels: vLLM loads
`_C_AVX2` and its non-AMX GEMM and attention paths when torch says AVX512/AMX are absent, ATen dispatches its AVX2 kernels under
`ATEN_CPU_CAPABILITY=avx2` and oneDNN its AVX2 ones under `ONEDNN_MAX_CPU_ISA=AVX2`. That this is
what an AVX2 machine computes is checked, not assumed: `--check-fixture` replays a bundle
recorded on a real AVX2 machine and must come out bit-exact.

    python tools/calibrate_platform_bounds.py --out /tmp/calib [--dtypes float32,bfloat16,float16]
        [--steps 0:8] [--pair native,avx2] [--check-fixture traces/avx2-mixed-step-eager.zst]

For each dtype it records the built-in workload's steps (eager) once per ISA, replays each set
on the other ISA in one engine, and prints per dtype the largest relative RMS and largest
max_abs / RMS over every float item (KV written, hidden states, logits) of every step.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIMULATED_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


# What vLLM asks before picking its kernel library (_C, _C_AVX512, _C_AVX2), GEMM and attention
# kernels; "avx512" is an AVX512 CPU without AMX (vLLM's bf16 attention then keeps the common KV
# layout), "avx2" one without AVX512 either.
_ABSENT = {
    "native": (),
    "avx512": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx2": ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
             "_is_amx_tile_supported", "_is_amx_fp16_supported"),
}


def _enter_isa(isa: str) -> None:
    """Runs first in a worker process, before vLLM picks its kernels."""
    import torch

    for probe in _ABSENT[isa]:
        setattr(torch.cpu, probe, lambda: False)


def _worker(argv: list[str]) -> None:
    kind, isa, *rest = argv
    _enter_isa(isa)
    if kind == "record":
        from tracekit.record.session import record_workload

        dtype, steps, out_dir = rest
        record_workload(engine_argv=["--enforce-eager", "--dtype", dtype], steps=steps,
                        output=str(Path(out_dir) / "step{step}.zst"))
        return
    from tracekit.replay.replayer import replay

    out_json, *bundles = rest
    results, llm = [], None
    for bundle in bundles:
        result = replay(bundle, llm=llm)
        llm = result.llm
        results.append({**result.to_plain(), "bundle": bundle})
    Path(out_json).write_text(json.dumps(results, default=str))


def _run_worker(*argv: str) -> None:
    isa = argv[1]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           **(SIMULATED_AVX2_ENV if isa == "avx2" else {})}
    done = subprocess.run([sys.executable, __file__, "--worker", *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker {argv[:2]} failed:\n{done.stderr[-4000:]}")


def _summarise(results: list[dict]) -> dict:
    worst: dict[str, dict] = {}
    for result in results:
        for check in result["checks"]:
            dtype = check.get("dtype")
            if dtype is None:
                if not check["bit_exact"]:
                    worst.setdefault("discrete_mismatches", []).append([result["bundle"], check["item"]])
                continue
            entry = worst.setdefault(dtype, {"items": 0, "bit_exact": 0, "relative_rms": 0.0, "max_abs_vs_rms": 0.0})
            entry["items"] += 1
            entry["bit_exact"] += check["bit_exact"]
            for key in ("relative_rms", "max_abs_vs_rms"):
                if entry[key] < check[key]:
                    entry[key], entry[f"{key}_at"] = check[key], f"{Path(result['bundle']).name}:{check['item']}"
    return worst


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return _worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--steps", default="0:8")
    parser.add_argument("--check-fixture", default=None)
    parser.add_argument("--pair", default="native,avx2", help="The two ISAs compared: native, avx512 (no AMX), avx2.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    if args.check_fixture:
        _run_worker("replay", "avx2", str(args.out / "fixture.json"), args.check_fixture)
        fixture = json.loads((args.out / "fixture.json").read_text())[0]
        report["fixture_on_simulated_avx2"] = {"verdict": fixture.get("verdict"), "bit_exact": fixture["bit_exact"]}
        print("fixture replayed on simulated AVX2:", report["fixture_on_simulated_avx2"], flush=True)
    for dtype in args.dtypes.split(","):
        first, second = args.pair.split(",")
        for recorded_on, replayed_on in ((first, second), (second, first)):
            bundles = args.out / f"{dtype}-{recorded_on}"
            bundles.mkdir(exist_ok=True)
            if not any(bundles.glob("*.zst")):
                _run_worker("record", recorded_on, dtype, args.steps, str(bundles))
            out = args.out / f"{dtype}-{recorded_on}-on-{replayed_on}.json"
            _run_worker("replay", replayed_on, str(out), *map(str, sorted(bundles.glob("*.zst"))))
            summary = _summarise(json.loads(out.read_text()))
            report[f"{dtype}: recorded {recorded_on}, replayed {replayed_on}"] = summary
            print(dtype, recorded_on, "->", replayed_on, json.dumps(summary), flush=True)
    (args.out / "summary.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
