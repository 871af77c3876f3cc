#!/usr/bin/env python3
"""What Model Runner V2's drafter reads per request, replayed in a folder and alone (issue 49).

    python tools/probe_slot_state.py DIR [--order name|reverse] [--json OUT]

V2 keeps each request's state in a slot of persistent per-slot buffers (`req_states`, the
sampler's states, the speculator's); a slot freed by a finished request keeps what that request
left until the next one writes it. A suite replay (`tracekit replay DIR`) replays its bundles on
one engine, so a bundle's requests may land in slots an earlier bundle's requests used. This probe
replays DIR's bundles in one process (as `tracekit replay DIR` does, in the order asked), then each
bundle alone in a fresh process, and at every drafter call (`speculator.propose`) of every replayed
step writes down, per request of the batch, what the drafter reads: its slot, how many tokens it
sampled this step, the slot's last sampled token, its next prefill tokens, its length, the drafts
proposed — and a digest of each per-slot buffer of the runner, sampler and speculator at that
slot (token rows up to the request's length: the drafter reads no further). It prints each
bundle's verdict both ways and every request whose reads differ between the two, by buffer.

On the GPU (vLLM 0.34, a folder recorded with ngram drafting and a long prompt chunk-prefilled
beside short requests), through tools/gpu_run.sh's kit:
    source .gpu-kit34/install.sh env && python3 tools/probe_slot_state.py FOLDER --json $OUT/probe.json
On this CPU (V2 through the test harness): with tests/harness/v2_on_cpu first on PYTHONPATH.
"""

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The drafter's reads of every replayed step, in the order they happened; the bundle being
# replayed is named by `_current`.
_calls: list[dict[str, Any]] = []
_current: dict[str, str] = {"bundle": ""}


def _host(value: Any) -> Any:
    """A torch tensor, a vLLM staged/UVA buffer (`.gpu`) or a NumPy array, as a host tensor; None
    for anything else."""
    import numpy
    import torch

    value = getattr(value, "gpu", value)
    if isinstance(value, numpy.ndarray):
        value = torch.from_numpy(value)
    return value.detach().to("cpu") if isinstance(value, torch.Tensor) else None


def _slot_buffers(runner: Any) -> dict[str, Any]:
    """Every per-slot buffer of the runner's request states, sampler and speculator, by name."""
    owners = {"req_states": getattr(runner, "req_states", None), "speculator": getattr(runner, "speculator", None)}
    sampler = getattr(runner, "sampler", None)
    if sampler is not None:
        owners.update({f"sampler.{name}": value for name, value in vars(sampler).items() if hasattr(value, "__dict__")})
    buffers = {}
    for owner_name, owner in owners.items():
        for name, value in (vars(owner).items() if owner is not None else ()):
            tensor = _host(value)
            if tensor is not None and tensor.dim() >= 1:
                buffers[f"{owner_name}.{name}"] = tensor
    return buffers


def _digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:12]


def _reads(runner: Any, bound: dict[str, Any]) -> list[dict[str, Any]]:
    """Per request of the drafter's batch: what it reads of its slot."""
    batch = bound["input_batch"]
    num_reqs = int(batch.num_reqs)
    slots = [int(slot) for slot in _host(batch.idx_mapping)[:num_reqs]]
    max_reqs = runner.req_states.max_num_reqs
    total_len = _host(runner.req_states.total_len)
    num_sampled = _host(bound.get("num_sampled"))
    last_sampled = _host(bound.get("last_sampled"))
    next_prefill = _host(bound.get("next_prefill_tokens"))
    buffers = _slot_buffers(runner)
    rows = []
    for row, (req_id, slot) in enumerate(zip(batch.req_ids, slots)):
        length = int(total_len[slot])
        digests = {}
        for name, tensor in buffers.items():
            if tensor.shape[0] == max_reqs:
                part = tensor[slot]
                if part.dim() == 1 and part.shape[0] == runner.max_model_len:
                    part = part[:length]  # a token row: the drafter reads up to the request's length
            elif tensor.dim() >= 2 and tensor.shape[1] == max_reqs:
                part = tensor[:, slot]
            else:
                continue
            digests[name] = _digest(part)
        rows.append({
            "req_id": req_id, "slot": slot, "total_len": length,
            "num_sampled": None if num_sampled is None else int(num_sampled[row]),
            "last_sampled": None if last_sampled is None else int(last_sampled.view(-1)[slot]),
            "next_prefill_tokens": None if next_prefill is None else next_prefill[:, slot].tolist(),
            "buffers": digests,
        })
    return rows


def _install_probe() -> None:
    """Every V2 runner built from now on reports its drafter's reads to `_calls`."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    original = GPUModelRunner.sample_tokens

    def sample_tokens(runner: Any, *args: Any, **kwargs: Any) -> Any:
        speculator = getattr(runner, "speculator", None)
        if speculator is not None and "propose" not in vars(speculator):
            propose = speculator.propose
            signature = inspect.signature(propose)

            def probed(*call_args: Any, **call_kwargs: Any) -> Any:
                bound = signature.bind(*call_args, **call_kwargs).arguments
                if bound.get("dummy_run"):
                    return propose(*call_args, **call_kwargs)
                rows = _reads(runner, bound)
                drafts = propose(*call_args, **call_kwargs)
                for row, proposed in zip(rows, _host(drafts).tolist()):
                    row["proposed"] = proposed
                _calls.append({"bundle": _current["bundle"], "rows": rows})
                return drafts

            speculator.propose = probed
        return original(runner, *args, **kwargs)

    GPUModelRunner.sample_tokens = sample_tokens


def replay_in_this_process(bundles: list[Path]) -> list[dict[str, Any]]:
    """Replay `bundles` in this order as one suite (one engine per configuration), probed."""
    from tracekit.replay.suite import run_suite

    _install_probe()
    verdicts = {}

    def on_start(position: int, bundle: Path, building: bool) -> None:
        _current["bundle"] = str(bundle)

    def on_done(record: Any) -> None:
        verdicts[record.bundle] = {"verdict": record.verdict,
                                   "first_divergence": record.result.first_divergence if record.result else record.error}

    run_suite(bundles, keep_going=True, modes=None, on_start=on_start, on_done=on_done)
    return [{"bundle": bundle, **outcome, "calls": [call["rows"] for call in _calls if call["bundle"] == bundle]}
            for bundle, outcome in verdicts.items()]


def replay_alone(bundle: Path) -> dict[str, Any]:
    """`bundle` replayed in a fresh process of this tool, probed."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"probe-slot-state-{os.getpid()}-{bundle.stem}.json"
    done = subprocess.run([sys.executable, __file__, "--alone", str(bundle), "--json", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        return {"bundle": str(bundle), "verdict": "probe failed", "first_divergence": done.stderr[-2000:], "calls": []}
    result = json.loads(out.read_text())[0]
    out.unlink()
    return result


def differences(suite: dict[str, Any], alone: dict[str, Any]) -> list[str]:
    """Each request whose drafter reads differ between the two replays, in words."""
    lines = []
    for call, (in_suite, by_itself) in enumerate(zip(suite["calls"], alone["calls"])):
        alone_rows = {row["req_id"]: row for row in by_itself}
        for row in in_suite:
            other = alone_rows.get(row["req_id"])
            if other is None:
                continue
            fields = [name for name in ("num_sampled", "last_sampled", "next_prefill_tokens", "total_len", "proposed")
                      if row[name] != other[name]]
            buffers = sorted(name for name, digest in row["buffers"].items() if other["buffers"].get(name) != digest)
            if fields or buffers:
                values = ", ".join(f"{name} {row[name]} (alone {other[name]})" for name in fields)
                lines.append(f"  drafter call {call}, request {row['req_id']} (slot {row['slot']}, alone "
                             f"{other['slot']}): {values or 'same reads'}; per-slot buffers that differ: "
                             f"{', '.join(buffers) or 'none'}")
    if len(suite["calls"]) != len(alone["calls"]):
        lines.append(f"  {len(suite['calls'])} drafter call(s) in the folder replay, {len(alone['calls'])} alone")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path)
    parser.add_argument("--order", choices=("name", "reverse"), default="name")
    parser.add_argument("--json", type=Path, help="write every replay's drafter reads here")
    parser.add_argument("--alone", type=Path, help=argparse.SUPPRESS)  # one bundle, in this process
    args = parser.parse_args()
    if args.alone is not None:
        args.json.write_text(json.dumps(replay_in_this_process([args.alone])))
        return 0
    from tracekit.bundles import find_bundles

    bundles = find_bundles([str(args.folder)])
    if args.order == "reverse":
        bundles.reverse()
    in_suite = replay_in_this_process(bundles)
    alone = {str(bundle): replay_alone(bundle) for bundle in bundles}
    leaks = 0
    for suite_result in in_suite:
        by_itself = alone[suite_result["bundle"]]
        lines = differences(suite_result, by_itself)
        leaks += bool(lines)
        print(f"{Path(suite_result['bundle']).name}: in the folder {suite_result['verdict']} "
              f"({suite_result['first_divergence'] or '-'}), alone {by_itself['verdict']} "
              f"({by_itself['first_divergence'] or '-'})")
        print("\n".join(lines) if lines else "  the drafter read the same of every request's slot")
    print(f"{leaks} of {len(in_suite)} bundle(s) read other per-slot state in the folder replay ({args.order} order) "
          "than alone")
    if args.json is not None:
        args.json.write_text(json.dumps({"order": args.order, "in_folder": in_suite, "alone": alone}, indent=1))
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
