"""A folder of bundles replayed three ways, for issue 49's isolation check: as `tracekit replay
DIR` replays it (name order, one engine), in the reverse order (one engine), and each bundle alone
in a fresh process. A suite isolates its bundles when every bundle gets one verdict all three ways.

Used by the CPU test (`test_suite_isolation.py`) and the GPU one (`tests/gpu/test_gpu_suite_isolation.py`),
each with its own way of starting `tracekit` (`run(*args)` -> a `Finished`).
"""

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from e2e_support import Finished

ORDERS = ("name order", "reverse order", "alone")


def _records(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    return {Path(record["bundle"]).name: record for record in map(json.loads, path.read_text().splitlines())}


def replay_three_ways(folder: Path, out: Path, run: Callable[..., Finished], parallel: int = 1
                      ) -> tuple[dict[str, dict[str, dict[str, Any]]], list[Finished]]:
    """Each order's `--json` records by bundle file name, and every replay process's outcome.
    `parallel`: how many of the fresh processes of the bundles alone run at once."""
    out.mkdir(parents=True, exist_ok=True)
    bundles = sorted(folder.glob("*.zst"))
    options = ("--keep-going", "--no-timing", "--json")
    finished = [run("replay", folder, *options, out / "name.jsonl"),
                run("replay", *reversed(bundles), *options, out / "reverse.jsonl")]

    def alone(bundle: Path) -> Finished:
        return run("replay", bundle, "--no-timing", "--json", out / f"alone-{bundle.stem}.jsonl")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        finished += list(pool.map(alone, bundles))
    records = {"name order": _records(out / "name.jsonl"), "reverse order": _records(out / "reverse.jsonl"),
               "alone": {}}
    for bundle in bundles:
        records["alone"].update(_records(out / f"alone-{bundle.stem}.jsonl"))
    return records, finished


def not_isolated(records: dict[str, dict[str, dict[str, Any]]], bundles: list[str]) -> list[str]:
    """Every bundle not bit-exact all three ways, with its verdict and first divergence in each."""
    lines = []
    for name in bundles:
        outcomes = {order: records[order].get(name) for order in ORDERS}
        if all(record is not None and record["verdict"] == "bit_exact" for record in outcomes.values()):
            continue
        lines.append(f"{name}: " + "; ".join(
            f"{order} {'no record' if record is None else record['verdict']}"
            f"{'' if record is None or record['first_divergence'] is None else ' at ' + record['first_divergence']}"
            for order, record in outcomes.items()))
    return lines
