"""What the end-to-end tests of structured outputs, LoRA and "cannot replay yet" share: the tiny
adapters, the recordings of `engine_scripts/record_features.py`, and reading their bundles."""

import json
import subprocess
import sys
from pathlib import Path

from e2e_support import bundles_by_step, engine_script, read_step, tracekit

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def make_adapter(folder: Path, seed: int) -> Path:
    """A tiny random peft adapter for the embedded model, made by the project's tool."""
    done = subprocess.run([sys.executable, str(TOOLS / "make_tiny_lora.py"), str(folder), "--seed", str(seed)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return folder


def record_features(work: Path, scenario: str, *adapters: Path, runner: str = "v1") -> tuple[dict, dict[int, Path]]:
    """Every step of a `record_features.py` scenario: its result JSON and bundles by step."""
    out = work / scenario
    out.mkdir()
    result = engine_script("record_features", work / f"{scenario}.json", out, scenario, *adapters, runner=runner)
    assert result["written"] and not result["failures"], result
    return result, bundles_by_step(out)


def replay_records(work: Path, name: str, *args, runner: str = "v1") -> tuple[object, dict[str, dict]]:
    """`tracekit replay ARGS --json`: the finished process and its records by bundle name."""
    out = work / f"{name}.jsonl"
    finished = tracekit("replay", *args, "--json", out, runner=runner)
    records = {Path(record["bundle"]).name: record
               for record in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    return finished, records


def checks_by_item(record: dict) -> dict[str, dict]:
    return {check["item"]: check for check in record["checks"]}


def grammar_kinds(path: Path) -> set[str]:
    """The kinds of grammar of the requests a step's mask covered: json, regex, and grammar (vLLM
    turns a choice into the grammar `root ::= "yes" | "no" | ...` when the request arrives)."""
    step = read_step(path)
    kinds = set()
    for req_id in step.grammar.request_ids if step.grammar is not None else ():
        spec = step.request(req_id).sampling_params["structured_outputs"]
        kinds |= {kind for kind in ("json", "regex", "grammar") if spec.get(kind) is not None}
    return kinds
