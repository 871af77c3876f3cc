"""What the end-to-end tests of structured outputs, LoRA and "cannot replay yet" share: the tiny
adapters, the recordings of `engine_scripts/record_features.py`, and reading their bundles."""

import json
import subprocess
import sys
from pathlib import Path

import torch
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
        spec = step.request(req_id).sampling_params.structured_outputs
        kinds |= {kind for kind in ("json", "regex", "grammar") if spec.get(kind) is not None}
    return kinds


# Edits of real recordings (`rewrite_bundle`), negative controls on the CPU and the GPU alike.

def flip_one_allowed_token(metadata, tensors):
    """Clear the bit of the first allowed token in the first row of the grammar mask."""
    flipped = clear_first_allowed_bit(tensors["steps/0/grammar/bitmask"])
    metadata["steps"][0]["test_flipped_token"] = flipped  # kept by readers as an unknown field


def clear_first_allowed_bit(mask: torch.Tensor) -> int:
    """Clear, in place, the bit of the first allowed token in the mask's first row; returns that token."""
    word = int(torch.nonzero(mask[0]).flatten()[0])
    value = int(mask[0, word]) & 0xFFFFFFFF
    bit = (value & -value).bit_length() - 1
    value ^= 1 << bit
    mask[0, word] = value - (1 << 32) if value >= 1 << 31 else value
    return 32 * word + bit


def swap_lora_slots(metadata, tensors):
    """The first two resident adapters trade slots."""
    adapters = metadata["steps"][0]["lora_adapters"]
    adapters[0]["slot"], adapters[1]["slot"] = adapters[1]["slot"], adapters[0]["slot"]


def drop_adapter_files(metadata, tensors):
    """The bundle keeps no adapter's files: the replay must find them elsewhere."""
    for position, adapter in enumerate(metadata["steps"][0]["lora_adapters"]):
        for name in adapter["files"]:
            del tensors[f"steps/0/lora_adapters/{position}/files/{name}"]
        adapter["files"] = {}
