"""Write tests/gpu/last-run.json: what the last GPU run of tracekit ran on, and what it found.

`tools/gpu_run.sh --quick COMMIT` calls this on the GPU machine, once per vLLM release it ran
(one run a file, back in $OUT); here the runs of one commit are merged into the file committed
with the change they checked. The before-stop check reads the commit it names (its first key)
and says when engine-facing code changed after it.

    python tools/gpu_last_run.py --commit C --seconds S --junit J --summary Q --gpu G --out RUN.json [--cut WHY]
    python tools/gpu_last_run.py --merge RUN.json [RUN.json ...] --out tests/gpu/last-run.json
    python tools/gpu_last_run.py --soak SUMMARY.json [SUMMARY.json ...] --commit C --gpu G --vllm V --out tests/gpu/last-run.json

`--soak` files `tools/serve_soak.py`'s summaries (one per model, a call each) under the key
`serve_soak` of the file, with the commit they ran on: a soak is not a quick run, so it leaves the
quick runs' commit and counts as they are.
"""

import argparse
import datetime
import importlib
import importlib.metadata
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def test_counts(junit: Path) -> dict[str, int]:
    """passed / failed / skipped, from pytest's JUnit XML."""
    if not junit.exists():
        return {}
    root = ElementTree.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(suite.get("tests", 0)) for suite in suites)
    failed = sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)
    skipped = sum(int(suite.get("skipped", 0)) for suite in suites)
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def version(package: str) -> str | None:
    """The package's version as it imports (a kit on PYTHONPATH may carry no metadata)."""
    try:
        return str(importlib.import_module(package).__version__)
    except Exception:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None


def repeated(kept: dict, again: dict) -> dict:
    """One configuration run again (lanes repeating it, as issue 49 asks of float32): its
    recordings, steps and bit-exact counts added up, its parted steps numbered on."""
    offset = kept.get("recordings", 0)
    joined = {**kept, "seconds": round(kept.get("seconds", 0) + again.get("seconds", 0), 1),
              "runs": kept.get("runs", 1) + again.get("runs", 1)}
    for name in ("bit_exact", "steps", "recordings"):
        joined[name] = kept.get(name, 0) + again.get(name, 0)
    joined["bit_exact_per_recording"] = kept.get("bit_exact_per_recording", []) + again.get("bit_exact_per_recording", [])
    joined["parted"] = kept.get("parted", []) + [{**step, "recording": step.get("recording", 0) + offset}
                                                 for step in again.get("parted", [])]
    joined["verdicts"] = sorted(set(kept.get("verdicts", [])) | set(again.get("verdicts", [])))
    joined["bit_exact_of_total"] = f"{joined['bit_exact']}/{joined['steps']}"
    return joined


def merged(runs: list[dict]) -> dict:
    """One file for the runs of one commit, by vLLM version; the calls one run was split over
    (`-k`) joined: their configurations (one run again: `repeated`), test counts and device
    seconds added up."""
    commits = {run["commit"] for run in runs}
    if len(commits) != 1:
        raise SystemExit(f"the runs are of different commits: {sorted(commits)}")
    by_version: dict[str, dict] = {}
    for run in sorted(runs, key=lambda run: run["ran_at"]):
        joined = by_version.setdefault(run["vllm"], {**run, "configurations": {}, "tests": {}, "device_seconds": 0})
        for name, configuration in run["configurations"].items():
            kept = joined["configurations"].get(name)
            joined["configurations"][name] = configuration if kept is None else repeated(kept, configuration)
        for name, count in run["tests"].items():
            joined["tests"][name] = joined["tests"].get(name, 0) + count
        joined["device_seconds"] += run["device_seconds"]
        joined["ran_at"] = run["ran_at"]
    return {"commit": commits.pop(), "runs": dict(sorted(by_version.items()))}


def soak_record(summaries: list[dict], commit: str, gpu: str, vllm: str) -> dict:
    """The serving soak's numbers a model, as the README's table shows them: each configuration's
    ratios against no_tracekit (its absolute numbers for no_tracekit itself), the bundles written
    and how many replayed bit-exact, the server log lines found, and any problem."""
    models = {}
    for summary in summaries:
        for result in summary["models"]:
            exact = sum(replay.get("verdict") == "bit_exact" for replay in result["replays"])
            models[result["model"]] = {
                "no_tracekit": result["runs"].get("no_tracekit"),
                "ratios": result["ratios"],
                "bundles": len(result["bundles"]),
                "replayed_bit_exact": f"{exact}/{len(result['replays'])}",
                "log_lines": result["log_lines"],
                "problems": result["problems"],
                "seconds": result["seconds"],
            }
    return {"commit": commit, "ran_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": gpu, "vllm": vllm, "models": models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merge", type=Path, nargs="+", help="runs of one commit to merge into --out")
    parser.add_argument("--soak", type=Path, nargs="+", help="serve_soak.py summaries to file under serve_soak in --out")
    parser.add_argument("--vllm", help="with --soak: the vLLM release it served")
    parser.add_argument("--commit")
    parser.add_argument("--seconds", type=float, help="device seconds the tests took")
    parser.add_argument("--junit", type=Path)
    parser.add_argument("--summary", type=Path)
    parser.add_argument("--gpu", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cut", help="how the run was cut short, where it was: its counts are of the tests it ran")
    args = parser.parse_args()
    if args.merge:
        record = merged([json.loads(path.read_text()) for path in args.merge])
        soak = json.loads(args.out.read_text()).get("serve_soak") if args.out.exists() else None
        args.out.write_text(json.dumps({**record, **({"serve_soak": soak} if soak else {})}, indent=1) + "\n")
        return
    if args.soak:
        if None in (args.commit, args.gpu, args.vllm):
            parser.error("--soak needs --commit --gpu --vllm")
        kept = json.loads(args.out.read_text()) if args.out.exists() else {}
        gpu = args.gpu.read_text().strip() if args.gpu.exists() else str(args.gpu)
        kept["serve_soak"] = soak_record([json.loads(path.read_text()) for path in args.soak], args.commit, gpu, args.vllm)
        args.out.write_text(json.dumps(kept, indent=1) + "\n")
        return
    if None in (args.commit, args.seconds, args.junit, args.summary, args.gpu):
        parser.error("a run needs --commit --seconds --junit --summary --gpu")
    summary = json.loads(args.summary.read_text()) if args.summary.exists() else {}
    record = {
        "commit": args.commit,
        "ran_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": args.gpu.read_text().strip() if args.gpu.exists() else None,
        "vllm": version("vllm"),
        "torch": version("torch"),
        "device_seconds": args.seconds,
        "tests": test_counts(args.junit),
        **({"cut": args.cut} if args.cut else {}),
        "configurations": {
            name: {**entry, "bit_exact_of_total": f"{entry['bit_exact']}/{entry['steps']}"}
            for name, entry in sorted(summary.items())
        },
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
