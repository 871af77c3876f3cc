"""Fuzz the bundle reader and every command that reads metadata, with mutated bundles.

    python tools/fuzz_bundle.py --seconds 60 [--jobs 2] [--cases N] [--seed S] [--save DIR]
    python tools/fuzz_bundle.py --case 1234 [--seed S]      # re-run one case here, with its traceback

Every case is one seed bundle (a few small ones written here, the v1 golden file, a real
recording, and that recording in schema version 2 with every optional part filled in) with 1-3
mutations, chosen and parameterized by a random generator seeded with the case number:

* damage, not re-signed: bit flips, overwritten runs, truncation, junk inserted or appended,
  equal-size frames swapped or copied over each other;
* forgeries, re-signed so that only the edit is wrong: header fields replaced by hostile
  values; the header's structure (a field given each other msgpack type, nesting from 63 to
  5000 deep, strings up to 1 MiB or claiming more bytes than exist, fields removed, thousands
  of extra or non-string keys, a key twice, a map count that lies, no map at all); any node
  of the index replaced by a hostile value (huge, negative, wrong type, other names,
  traversal-like dtypes) or deleted, frame entries reordered, tensors duplicated, valid extra
  frames hidden between data frames, bytes appended to a frame inside its indexed extent
  (junk, a zstd magic, an empty zstd frame), and crafted metadata (nesting thousands deep,
  10^4-10^6 `$tensor` references, megabytes of empty maps, extension types, markup and ANSI
  escapes in strings);
* metadata retyped, re-signed (issue 33: an int where `output_token_ids` belongs passed the
  reader and crashed `tracekit inspect`): 1-4 nodes of the metadata tree — half of them map
  entries (the schema's fields and vLLM's), half any node (a token id in its list) — given a
  value of another msgpack type (int, float, str, bool, nil, list, map, bin; int32, int64 and
  uint64 edges, NaN and infinities, strings the schema's string fields switch on, hostile text),
  a tensor reference (to another tensor, or not a reference), wrapped in a list or map,
  unwrapped to an element, or its number made huge or negative; or deleted, or given a sibling.

Why a custom structural mutator, not Hypothesis or atheris: the reader's interesting failures
sit behind hashes (sha256 of the index, CRC-32 and checksums of frames), so blind byte
mutation (atheris, libFuzzer) almost never gets past the trailer; mutations must understand the
layout and re-sign. Hypothesis could drive such mutations, but its engine runs examples in the
test process, where a hang or an out-of-memory kill takes the whole run down, and its shrinking
is of little use when a case is already one seed and a few named edits. Here each case runs in
a worker process under an RLIMIT_AS cap and a per-case timeout, and any case is reproduced from
its number alone (`--case N`).

Each case is classified (a case lands in the first class that applies):

  refused            a BundleError on open (fine)
  read               opened; every read agreed with verify (fine)
  foreign            an exception other than BundleError escaped the API
  different-data     a read returned bytes other than those written (damage only, not forgeries)
  inconsistent       verify() and the reads disagree (verify ok but a read fails, or verify
                     names a part damaged whose verified read succeeds)
  hidden-bytes       opened although bytes outside header, frames, index and trailer exist, or
                     a part verify() calls intact has bytes after its zstd frame's end, inside
                     the frame's indexed extent
  bad-header         opened although a header field docs/FORMAT.md names has another type, or
                     the header nests deeper than the cap (64)
  cli-crash          a command misbehaved: it exited with a code outside its contract, raised
                     anything but tracekit's one-line error, printed a traceback, more than one
                     error line, or an unescaped control character from the bundle.
                     `tracekit inspect --verify` runs on every other case (as a table on every
                     fourth of those, else --json, every other one with --full); on every bundle
                     the reader accepts whose metadata holds recorded content, every command
                     that reads metadata runs, in this process through click's test runner:
                     `inspect` (table), `inspect --json --full`, `diff --json` against its seed,
                     `export --shapes -o -`, `redact` (since 2026-12-05: it derives a window's
                     later request states), and `replay --no-timing` up to the engine build
                     (the functions the command calls, `checked_before_engine` last: it stops where
                     vLLM would take over)
  memory             MemoryError escaped, or the worker died (the RLIMIT_AS cap or a signal)
  timeout            the case used more than --timeout CPU seconds, or ran 6x that long on the
                     clock (the worker is then killed)
  slow               the case used more than --slow CPU seconds

Times are the worker's CPU time (user + system, all its threads), not the clock's: on a shared
machine the clock says more about the neighbours than about the reader.

The counts end with how each command ended on the bundles holding recorded content (exit
codes; for the replay, the error class or `reached the engine build`) and the number of
tracebacks (foreign + cli-crash). Exit status 1 when any class other than refused/read/slow has
a case. The last long campaign (2026-12-04, `--cases 100000 --seed 33 --jobs 2`, 4,223 s on 2
shared cores): 55,147 read, 44,853 refused, every other class 0; the commands ran on 34,358
bundles holding recorded content; 0 tracebacks (docs/FORMAT-RATIONALE.md has the details).
"""

import argparse
import copy
import hashlib
import os
import random
import resource
import select
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import msgpack
import numpy as np
import zstandard

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "traces" / "golden-v1.zst"
RECORDED = REPO / "traces" / "tiny-llama-mixed-step.zst"  # a real recording (schema version 1, V1 runner)
FINE = ("refused", "read", "slow")
CLASSES = ("refused", "read", "foreign", "different-data", "inconsistent", "hidden-bytes", "bad-header", "cli-crash",
           "memory", "timeout", "slow")
HEADER, INDEX, TRAILER = 0x184D2A50, 0x184D2A5E, 0x184D2A5F
TRAILER_LAYOUT = struct.Struct("<8sQQ32s")
HOSTILE_TEXT = ["[/]", "[bold red]x[/]", "\x1b[2J\x1b[31mred", "\u202eevil", "a\nb", "\x00", "../../etc/passwd", "é" * 300]


# ---------------------------------------------------------------------------- seed bundles

def write_seeds(directory: Path) -> list[Path]:
    """Small bundles covering the reader's paths: shuffled multi-chunk tensors, plain ones,
    numpy-less dtypes, a step-schema bundle for inspect's tables, hostile names; golden v1; a
    real recording, and the same in schema version 2 with every optional part filled in (runner
    state of both runner kinds, rank fields, derivations, an error, per-layer outputs,
    speculative decoding, a window)."""
    from tracekit.format import BundleWriter
    from tracekit.format.rewrite import rewrite_bundle

    rng = np.random.default_rng(0)
    seeds = []
    path = directory / "mixed.zst"
    with BundleWriter(path, chunk_bytes=8192) as writer:
        bf16 = (rng.standard_normal(12288).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        kv = writer.add_tensor("kv/layer.0", bf16.reshape(2, 64, 96))  # uint16 stands in for bf16 bytes
        writer.add_tensor("f32", rng.standard_normal(20000).astype(np.float32))
        ids = writer.add_tensor("ids", np.arange(40, dtype=np.int64))
        writer.add_tensor("mask", np.array([True, False, True]))
        writer.add_tensor("empty", np.zeros((0, 3), dtype=np.float16))
        writer.set_metadata({"name": "mixed", "kv": kv, "again": [kv, ids, {"deep": ids}], "n": [1, 2.5, None, b"x"]})
    seeds.append(path)
    path = directory / "step.zst"
    with BundleWriter(path) as writer:
        ids = writer.add_tensor("steps/0/input_ids", np.arange(9, dtype=np.int64))
        request = {"prompt_token_ids": [1, 2, 3], "output_token_ids": [], "block_ids": [[0]], "num_computed_tokens": 0,
                   "num_scheduled_tokens": 3}
        writer.set_metadata({
            "environment": {"tracekit_version": "0.1.0", "vllm_version": "0.32.0", "device_name": HOSTILE_TEXT[2]},
            "engine": {"vllm_version": "0.32.0", "engine_args": {}, "model": {"path": HOSTILE_TEXT[1]},
                       "num_kv_blocks": 8, "block_size": 16},
            "steps": [{"index": 0, "trigger": HOSTILE_TEXT[0], "scheduler_output": {}, "batch_order": ["a"],
                       "requests": [dict(request, req_id=HOSTILE_TEXT[2]), dict(request, req_id="[/]")],
                       "input_ids": ids, "positions": ids, "kv": {"mode": "read", "groups": []},
                       "graph": {"compilation_mode": "NONE", "cudagraph_mode": "NONE"},
                       "error": {"type": "[/]", "message": HOSTILE_TEXT[3]}}],
        })
    seeds.append(path)
    path = directory / "names.zst"
    with BundleWriter(path) as writer:
        for number, name in enumerate(HOSTILE_TEXT):
            writer.add_tensor(name, np.full(number + 1, number, dtype=np.int32))
        writer.set_metadata({text: text for text in HOSTILE_TEXT})
    seeds.append(path)
    seeds.append(GOLDEN)
    seeds.append(RECORDED)
    seeds.append(rewrite_bundle(RECORDED, directory / "recorded-v2.zst", filled_in_schema_2))
    return seeds


def filled_in_schema_2(metadata: dict, tensors: dict) -> None:
    """A recording's metadata as schema version 2 writes it, with the optional parts set."""
    metadata["schema_version"] = 2
    step = metadata["steps"][0]
    for number, request in enumerate(step["requests"]):
        generator_state = request.pop("generator_state", None)
        request["runner_state"] = {"generator_state": generator_state} if generator_state else {}
        if number == 0:  # V2 keeps these
            request["runner_state"].update(seed=12345, prefill_len=len(request["prompt_token_ids"]))
    metadata["parallel"] = {"world_size": 1, "rank": 0, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                            "tp_rank": 0, "pp_rank": 0, "set_id": "session", "parts": ["recorded-v2.zst"]}
    metadata["derivations"] = [{"kind": "redact", "tool": "tracekit", "neutral_token_id": 0, "removed": ["prompts"],
                                "steps": [{"history_kept": {"0": ["penalties"]}}], "env_vars_removed": ["X"]},
                               {"kind": "shrink", "from": {"file": "a.zst", "sha256": "00"}, "property": "diverged"}]
    metadata["environment"].update(attention_backend="CPU_ATTN/vec", num_threads=2, env_prefixes=["VLLM_"])
    step["error"] = {"type": "RuntimeError", "message": "boom", "traceback": "...", "phase": "forward"}
    step["timing"].update(forward_timer="perf_counter", device_copy_us=1.5, first_of_its_size=True)
    step["outputs"]["layers"] = {"model.norm": step["outputs"]["hidden_states"]}
    step["kv"]["taken"] = "before_forward"
    # speculative decoding: a request's drafts, the drafter's calls and proposals, the draft model
    hidden = step["outputs"]["hidden_states"]
    step["requests"][0]["draft_token_ids"] = [5, 6]
    step["requests"][0]["runner_state"]["draft_probs"] = hidden
    step["spec_decode"] = {"method": "eagle", "num_speculative_tokens": 2, "proposals": step["input_ids"],
                           "drafter_calls": [{"input_ids": step["input_ids"], "positions": step["positions"],
                                        "hidden_states_in": hidden, "hidden_states": hidden}],
                           "padded_drafter_batch": True}
    metadata["engine"]["draft_model"] = {"path": "/nowhere/draft", "architecture": "EagleLlamaForCausalLM",
                                         "weights_fingerprint": "dummy"}
    metadata["engine"]["engine_args"]["speculative_config"] = {"method": "eagle", "num_speculative_tokens": 2}
    later = step["index"] + 1  # a window of two steps: the later one repeats the first's deltas
    step["window"] = {
        "requested": 3,
        "steps": [{"index": later, "scheduler_output": copy.deepcopy(step["scheduler_output"]),
                   "batch_order": list(step["batch_order"]),
                   "runner_states": {step["requests"][0]["req_id"]: {"seed": 7, "prefill_len": 3}},
                   "input_ids": step["input_ids"], "positions": step["positions"], "graph": step["graph"],
                   "rng": step["rng"], "outputs": {name: step["outputs"][name]
                                                   for name in ("hidden_states", "logits", "sampled_token_ids")},
                   "timing": {"forward_us": 1.5}, "grammar": None}],
        "held_requests": [],
        "calls": [{"call": call, "step": index} for index in (step["index"], later) for call in ("execute", "sample", "output")],
    }
    # Issue 31: a grammar mask (as received, as it reached the logits), a LoRA adapter kept whole,
    # and which requests used them.
    first = step["requests"][0]["req_id"]
    words = -(-np.asarray(tensors["steps/0/outputs/logits"]).shape[-1] // 32)
    tensors["steps/0/grammar/bitmask"] = np.full((3, words), -1, dtype=np.int32)  # its token and 2 drafts
    tensors["steps/0/outputs/grammar_bitmask"] = np.full((len(step["requests"]), words), -1, dtype=np.int32)
    step["grammar"] = {"request_ids": [first], "rows_per_request": [3], "num_acceptable_drafts": [2],
                       "bitmask": {"$tensor": "steps/0/grammar/bitmask"}}
    step["outputs"]["grammar_bitmask"] = {"$tensor": "steps/0/outputs/grammar_bitmask"}
    config = "steps/0/lora_adapters/0/files/adapter_config.json"
    tensors[config] = np.frombuffer(b'{"r": 8, "lora_alpha": 16}', dtype=np.uint8).copy()
    step["lora_adapters"] = [{"name": "a", "int_id": 1, "slot": 0, "path": "/adapters/a", "rank": 8, "alpha": 16.0,
                              "target_modules": ["q_proj"], "fingerprint": "blake2b-128:00", "size_bytes": 26,
                              "files": {"adapter_config.json": {"$tensor": config}}}]
    step["requests"][0]["lora_adapter"] = "a"
    step["features"] = {"structured_outputs": [first], "lora": [first], "speculative_decoding": [first]}


def seed_paths(directory: Path) -> list[Path]:
    """The seeds write_seeds() wrote, in its order (a case number picks among them)."""
    return [directory / "mixed.zst", directory / "step.zst", directory / "names.zst", GOLDEN, RECORDED,
            directory / "recorded-v2.zst"]


# How often a case starts from each seed (write_seeds' order): the bundles holding recorded
# content more often, as the metadata mutations aim at its schema.
SEED_WEIGHTS = (1, 2, 1, 1, 3, 3)


# ---------------------------------------------------------------------------- mutations

def parse(data: bytes):
    """(header map, index map, index offset) parsed the way docs/FORMAT.md says; None if the
    file does not parse that far (the mutator then falls back to byte damage)."""
    try:
        header_length = struct.unpack_from("<I", data, 4)[0]
        header = msgpack.unpackb(data[8:8 + header_length])
        _, index_offset, index_length, _ = TRAILER_LAYOUT.unpack_from(data, len(data) - TRAILER_LAYOUT.size)
        index = msgpack.unpackb(data[index_offset + 8:index_offset + 8 + index_length], strict_map_key=False)
        return header, index, index_offset
    except Exception:
        return None


def frame_entries(index) -> list[list]:
    entries = [frame for tensor in index["tensors"] for chunk in tensor["chunks"] for frame in chunk["frames"]]
    return entries + [index["metadata"]["frame"]]


def assemble(header, frames: list[bytes], index, entries: list[list], hidden: dict | None = None) -> bytes:
    """A re-signed bundle: header (a map, or its payload as bytes), `frames` in order
    (entries[i] describes frames[i]; offsets are redone), the index and trailer. `hidden`
    inserts {position: bytes} not in the index."""
    header_payload = header if isinstance(header, bytes) else msgpack.packb(header)
    out = bytearray(struct.pack("<II", HEADER, len(header_payload)) + header_payload)
    for number, (frame, entry) in enumerate(zip(frames, entries)):
        out += (hidden or {}).get(number, b"")
        entry[0], entry[1] = len(out), len(frame)
        out += frame
    if isinstance(index, dict):
        index["header_sha256"] = hashlib.sha256(header_payload).digest()
    index_payload = msgpack.packb(index)
    index_offset = len(out)
    out += struct.pack("<II", INDEX, len(index_payload)) + index_payload
    out += struct.pack("<II", TRAILER, TRAILER_LAYOUT.size)
    out += TRAILER_LAYOUT.pack(b"TRACEKIT", index_offset, len(index_payload), hashlib.sha256(index_payload).digest())
    return bytes(out)


def hostile_value(rng: random.Random, names: list[str]):
    return rng.choice([
        -1, 0, 1, 2**31, 2**32 + 1, 2**63 - 1, 2**64 - 1, -2**63, 1.5, float("nan"), True, None, "", "x" * 2000,
        "uint8../../etc/passwd", "bfloat16", "shuffle", [], {}, [0, 0, 0, 0], [0] * 5, b"\0" * 32,
        rng.choice(names) if names else "t", rng.choice(HOSTILE_TEXT), list(range(rng.randrange(1, 200))),
    ])


def nodes(value, path=()):
    """Every (container, key) in the index tree, to pick one to edit."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found.append((value, key))
        found.extend(nodes(child))
    return found


# Values of every msgpack type, hostile ones of each: issue 33's ints where lists belong
# (2147483647, -2147483647, 274877906944), the edges of int32/int64/uint64, floats that are no
# numbers, strings the schema's string fields might switch on, containers of the wrong element.
RETYPED = {
    "int": [0, 1, -1, 2147483647, -2147483647, 274877906944, 2**31, -2**31 - 1, 2**63 - 1, -2**63, 2**64 - 1],
    "float": [0.0, 1.5, -1.5, float("nan"), float("inf"), float("-inf"), 1e308, -0.0],
    "str": ["", "0", "1", "x", "none", "read", "recompute", "v2", "FULL", "cuda", "0.32.0", "99.0", *HOSTILE_TEXT],
    "bool": [True, False],
    "nil": [None],
    "list": [[], [0], [1, 2, 3], [-1] * 5, ["a"], [None], [[1]], [[]], [{}], [2**63 - 1], [1.5], [True]],
    "map": [{}, {"a": 1}, {"$tensor": 5}, {1: 2}, {"": None}, {"num_tokens": "x"}, {"seed": 2**64 - 1}],
    "bin": [b"", b"\0\1"],
}


def retyped(value, rng: random.Random, names: list[str]):
    """`value` replaced by one of another type (or a hostile one of its own): a scalar, a
    container, a tensor reference, itself wrapped or unwrapped, or its number made huge or
    negative."""
    choice = rng.randrange(12)
    if choice < 8:
        return rng.choice(RETYPED[rng.choice(list(RETYPED))])
    if choice == 8:
        return rng.choice([{"$tensor": rng.choice(names or ["x"])}, {"$tensor": "steps/0/rng/cpu"}])
    if choice == 9:
        return rng.choice([[value], {"k": value}, {"$tensor": value} if isinstance(value, str) else [[value]]])
    if choice == 10:  # unwrapped: a list's element or a map's value in place of the container
        items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else []
        return rng.choice(items) if items else rng.choice(RETYPED["nil"] + RETYPED["list"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return rng.choice(RETYPED["int"])
    return rng.choice([-value, value + 1, value - 1, -1, value + 2**31, value * 2**40, value * 2**62, 2**63 - value])


def retype_metadata(metadata, rng: random.Random, names: list[str]):
    """The metadata with 1-4 of its nodes retyped, deleted, or given a hostile sibling. Half the
    picks are among map entries (the schema's fields and vLLM's), half among every node (a token
    id in a list, a list in a list)."""
    if not isinstance(metadata, (dict, list)):
        return retyped(metadata, rng, names)
    targets = nodes(metadata)
    fields = [(container, key) for container, key in targets if isinstance(container, dict)]
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        container, key = rng.choice(fields if fields and rng.random() < 0.5 else targets)
        choice = rng.random()
        if isinstance(container, dict) and choice < 0.1:
            container.pop(key, None)
        elif isinstance(container, dict) and choice < 0.15:
            container[rng.choice(["added_later", "$type", "extras", 7])] = retyped(container.get(key), rng, names)
        else:
            container[key] = retyped(container[key], rng, names)
    return metadata


def resign_metadata(frames: list[bytes], entries: list[list], index, content: bytes) -> None:
    """Put `content` (a packed {"metadata": ...}) in the metadata frame, every hash redone."""
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(content)
    frames[-1] = frame
    entry = entries[-1]
    entry[2], entry[3] = len(content), zlib.crc32(frame)
    if len(entry) > 4:
        entry[4] = int.from_bytes(frame[-4:], "little")
    index["metadata"]["sha256"] = hashlib.sha256(content).digest()


def crafted_metadata(rng: random.Random, names: list[str]) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        depth = rng.choice([65, 100, 1000, 1023, 1025, 5000])
        return b"\x81\xa8metadata" + b"\x91" * depth + b"\xc0"
    if kind == 1:
        count = rng.choice([1000, 20000] * 4 + [100_001, 1_000_000])  # the big ones cost the fuzzer seconds
        ref = msgpack.packb({"$tensor": rng.choice([name for name in names if len(name) < 64] or ["x"])})
        return b"\x81\xa8metadata" + b"\xdd" + struct.pack(">I", count) + ref * count
    if kind == 2:  # megabytes of empty maps: 1 byte packed, ~64 in Python
        count = rng.choice([1 << 16, 1 << 20] * 4 + [8 << 20, 60 << 20])
        return b"\x81\xa8metadata" + b"\xdd" + struct.pack(">I", count) + b"\x80" * count
    if kind == 3:  # an extension type, a timestamp, non-string keys
        return msgpack.packb({"metadata": {1: rng.choice([msgpack.ExtType(5, b"\0" * 4), msgpack.Timestamp(0, 0)])}})
    if kind == 4:  # markup and escapes where inspect prints them
        text = rng.choice(HOSTILE_TEXT)
        return msgpack.packb({"metadata": {"environment": {"tracekit_version": text}, "engine": {
            "vllm_version": text, "engine_args": {}, "model": {"path": text}, "num_kv_blocks": text, "block_size": 1},
            "steps": [{"index": text, "trigger": text, "scheduler_output": {}, "batch_order": text, "requests": [
                {"req_id": text, "prompt_token_ids": text, "output_token_ids": 5, "block_ids": text,
                 "num_computed_tokens": text, "num_scheduled_tokens": text}] * rng.choice([1, 300]),
                "input_ids": None, "positions": None, "kv": {"mode": text, "groups": [{"layer_names": text, "layout": {
                    "shape": text, "dtype": text, "block_dim": text, "num_blocks": 1, "block_size": 1},
                    "read_block_ids": 7, "written_block_ids": text, "saved_block_ids": None}]},
                "graph": {"compilation_mode": text, "cudagraph_mode": text, "capture_sizes": text, "num_tokens": text},
                "timing": {"forward_us": text, "step_us": 1.0}, "error": rng.choice([text, [text], {"type": text}])}]}},
            use_bin_type=True)
    if kind == 5:
        return msgpack.packb({"metadata": {"$tensor": rng.choice(["absent", *names])}})
    if kind == 6:
        return msgpack.packb(rng.choice([{"nometadata": 1}, [1, 2], "metadata", {"metadata": None}]))
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))


HEADER_FIELDS = ("magic", "format_version", "min_reader_version", "writer")  # docs/FORMAT.md, "Header"


def packed_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from already packed (key, value) pairs (duplicates kept as given)."""
    count = len(pairs)
    head = bytes([0x80 | count]) if count < 16 else b"\xde" + struct.pack(">H", count) if count < 1 << 16 else \
        b"\xdf" + struct.pack(">I", count)
    return head + b"".join(key + value for key, value in pairs)


def nested(rng: random.Random, depth: int) -> bytes:
    """A list or map nested `depth` deep (msgpack.packb stops at 511)."""
    if rng.random() < 0.5:
        return b"\x91" * (depth - 1) + b"\x90"
    return b"\x81\xa1k" * (depth - 1) + b"\x80"


def other_typed_value(rng: random.Random) -> bytes:
    """A packed value of some msgpack type, for a header field that wants another."""
    return rng.choice([
        msgpack.packb(rng.choice(["", "tracekit.bundle", "tracekit 0.1.0", rng.choice(HOSTILE_TEXT)])),
        msgpack.packb(rng.choice([0, 1, 2, 3, -1, 2**31, 2**63 - 1, 2**64 - 1, -2**63])),
        msgpack.packb(rng.choice([1.0, 2.0, float("nan"), float("inf")])),
        msgpack.packb(rng.choice([True, False, None])),
        msgpack.packb(rng.choice([b"", b"tracekit.bundle", b"\0" * 32]), use_bin_type=True),
        msgpack.packb(rng.choice([[], ["tracekit 0.1.0"], [2], list(range(100))])),
        msgpack.packb(rng.choice([{}, {"name": "tracekit"}, {"$tensor": "ids"}, {1: 2}])),
        msgpack.packb(msgpack.ExtType(rng.randrange(128), b"\0" * rng.choice([1, 4, 16]))),
        b"\xd6\xff\x00\x00\x00\x00",  # a timestamp (extension type -1)
        nested(rng, rng.choice([2, 8, 63, 64, 65])),
    ])


def mutated_header(header, rng: random.Random) -> bytes:
    """The header's payload with its structure edited (kept as packed bytes so that it may hold
    what msgpack.packb refuses): a field given another type, nesting hundreds deep, huge
    strings, fields removed or added, duplicate or non-string keys, or no map at all. The
    caller re-signs it (the index's header_sha256)."""
    fields = {key: msgpack.packb(value) for key, value in header.items()} if isinstance(header, dict) else {}
    pairs = [(msgpack.packb(key), value) for key, value in fields.items()]
    choice = rng.randrange(8)
    key = rng.choice(list(HEADER_FIELDS) * 3 + ["added_later", rng.choice(HOSTILE_TEXT)])
    packed_key = msgpack.packb(key)
    pairs = [(name, value) for name, value in pairs if name != packed_key]
    if choice == 0:  # a field of another type
        pairs.append((packed_key, other_typed_value(rng)))
    elif choice == 1:  # nesting around the caps: the reader's 64, msgpack's 1024, Python's recursion limit
        pairs.append((packed_key, nested(rng, rng.choice([63, 64, 65, 100, 999, 1000, 1023, 1024, 1025, 5000]))))
    elif choice == 2:  # huge strings, under and over the 64 KiB payload cap, or claiming more than is there
        length = rng.choice([1000, 60_000, 65_000, 70_000, 1 << 20])
        if rng.random() < 0.8:
            pairs.append((packed_key, msgpack.packb(rng.choice(["x", "\x1b[2J", "é", "[/]"]) * length)))
        else:
            pairs.append((packed_key, b"\xdb" + struct.pack(">I", length)))  # last: the claim runs off the end
    elif choice == 3:  # fields missing
        for _ in range(rng.choice([1, 1, 2, 4])):
            pairs = [pair for pair in pairs if pair[0] != msgpack.packb(rng.choice(HEADER_FIELDS))]
        if key not in HEADER_FIELDS:
            pairs.append((packed_key, fields.get(key, msgpack.packb(1))))
    elif choice == 4:  # extra fields: many, non-string keys, hostile keys
        pairs.append((packed_key, fields.get(key, msgpack.packb(None))))
        for number in range(rng.choice([1, 10, 1000, 5000])):
            pairs.append((rng.choice([msgpack.packb(f"extra{number}"), msgpack.packb(number), msgpack.packb(b"k" + bytes([number % 256]), use_bin_type=True),
                                      msgpack.packb(rng.choice(HOSTILE_TEXT)), b"\xc0", b"\xc3"]), msgpack.packb(number)))
    elif choice == 5:  # a known key twice: the second wins in msgpack, the first may be what a checker saw
        pairs.append((packed_key, fields.get(key, msgpack.packb("tracekit 0.1.0"))))
        pairs.append((packed_key, other_typed_value(rng)))
    elif choice == 6:  # no map at all
        return rng.choice([msgpack.packb(["tracekit.bundle", 2, 2]), msgpack.packb("tracekit.bundle"), b"\xc0", b"",
                           nested(rng, rng.choice([64, 1000, 2000]))])
    else:  # the map's count claims more entries than it holds, or fewer
        payload = packed_map(pairs)
        return (b"\xdf" + struct.pack(">I", rng.choice([len(pairs) + 1, 1 << 20, 2**32 - 1])) + payload[1:]
                if rng.random() < 0.7 else payload[:-rng.randrange(1, 4)])
    if rng.random() < 0.3:
        rng.shuffle(pairs)
    return packed_map(pairs)


def padded(frame: bytes, rng: random.Random) -> bytes:
    """A frame with bytes after its end: what zstd ignores, but an extent must not hold."""
    empty = zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    return frame + rng.choice([b"\0", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 33))), b"\x28\xb5\x2f\xfd",
                               empty, frame[:4], b"\x50\x2a\x4d\x18\0\0\0\0"])


METADATA_RETYPE_KINDS = 13  # of 30 mutation kinds, for a parsed bundle: the metadata's types
RETYPED_METADATA_BYTES = 1 << 20  # metadata larger than this (a crafted bomb) is not retyped


def mutate(seed: bytes, rng: random.Random) -> tuple[bytes, bool]:
    """(mutated bytes, whether the mutations were only damage, so any accepted read must give
    the intact bytes)."""
    data = seed
    damage_only = True
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            data, damage_only = mutate_once(data, damage_only, rng)
        except Exception:  # the mutator tripped over an earlier edit: skip this one
            continue
    return data, damage_only


def mutate_once(data: bytes, damage_only: bool, rng: random.Random) -> tuple[bytes, bool]:
    """One mutation, chosen and parameterized by `rng` (see the module docstring)."""
    parsed = parse(data)
    kind = rng.randrange(17 + METADATA_RETYPE_KINDS if parsed else 6)
    if kind == 0:
        flipped = bytearray(data)
        for _ in range(rng.choice([1, 1, 2, 8])):
            position = rng.randrange(len(flipped))
            flipped[position] ^= 1 << rng.randrange(8)
        data = bytes(flipped)
    elif kind == 1:
        start = rng.randrange(len(data))
        length = rng.choice([1, 4, 8, 64, 1000])
        data = data[:start] + bytes(rng.randrange(256) for _ in range(min(length, len(data) - start))) + data[start + length:]
    elif kind == 2:
        data = data[: rng.randrange(len(data))]
    elif kind == 3:
        position = rng.randrange(len(data) + 1)
        data = data[:position] + bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 100]))) + data[position:]
    elif kind == 4:
        data = data + rng.choice([b"\0", b"junk" * 10, data[-64:]])
    elif kind == 5 and parsed:
        entries = frame_entries(parsed[1])
        by_size = {}
        for entry in entries:
            by_size.setdefault(entry[1], []).append(entry)
        pairs = [group for group in by_size.values() if len(group) > 1]
        if pairs:
            first, second = rng.sample(rng.choice(pairs), 2)
            out = bytearray(data)
            a, b = data[first[0]:first[0] + first[1]], data[second[0]:second[0] + second[1]]
            out[second[0]:second[0] + second[1]] = a
            if rng.random() < 0.5:  # swap rather than copy
                out[first[0]:first[0] + first[1]] = b
            data = bytes(out)
    elif kind >= 6 and parsed:
        header, index, _ = parsed
        entries = frame_entries(index)
        frames = [data[entry[0]:entry[0] + entry[1]] for entry in entries]
        names = [tensor.get("name") for tensor in index.get("tensors", []) if isinstance(tensor, dict)]
        names = [name for name in names if isinstance(name, str)]
        damage_only = False
        hidden = None
        if kind == 6:
            header[rng.choice(["format_version", "min_reader_version", "magic", "writer", "new"])] = hostile_value(rng, names)
        elif kind in (14, 15):  # the header's structure, re-signed
            header = mutated_header(header, rng)
        elif kind == 16:  # bytes after a frame's end inside its extent, re-signed
            number = rng.randrange(len(frames))
            frames[number] = padded(frames[number], rng)
            entries[number][3] = zlib.crc32(frames[number])
            if len(entries[number]) > 4:
                entries[number][4] = int.from_bytes(frames[number][-4:], "little")
        elif kind in (7, 8, 9):
            targets = nodes(index)
            for _ in range(rng.choice([1, 1, 2, 4])):
                container, key = rng.choice(targets)
                if isinstance(container, dict) and rng.random() < 0.2:
                    container.pop(key, None)
                else:
                    container[key] = hostile_value(rng, names)
        elif kind == 10:  # reorder, duplicate or drop structure, keeping frames in place
            tensors = index["tensors"]
            choice = rng.randrange(4)
            if choice == 0 and len(tensors) > 1:
                rng.shuffle(tensors)
            elif choice == 1 and tensors:
                tensors.append(dict(rng.choice(tensors)))
            elif choice == 2:
                chunk = rng.choice([chunk for tensor in tensors for chunk in tensor["chunks"]] or [{"frames": []}])
                chunk["frames"].reverse()
            else:
                index["tensors"] = tensors * rng.choice([2, 50])
        elif kind == 11:  # valid zstd frames or junk hidden between data frames
            junk = zstandard.ZstdCompressor(write_checksum=True).compress(b"hidden" * rng.randrange(1, 100))
            hidden = {rng.randrange(len(frames) + 1): rng.choice([junk, b"\0" * 13, frames[0]])}
        elif kind in (12, 13):  # crafted metadata, re-signed
            resign_metadata(frames, entries, index, crafted_metadata(rng, names))
        elif kind >= 17:  # the metadata's own nodes retyped, re-signed
            if max(entries[-1][2], zstandard.frame_content_size(frames[-1])) > RETYPED_METADATA_BYTES:
                raise ValueError("a metadata bomb an earlier mutation crafted: not unpacked here")
            wrapper = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(frames[-1]), raw=False, strict_map_key=False)
            wrapper["metadata"] = retype_metadata(wrapper["metadata"], rng, names)
            resign_metadata(frames, entries, index, msgpack.packb(wrapper, use_bin_type=True))
        try:
            data = assemble(header, frames, index, entries, hidden)
        except Exception:  # an edit msgpack cannot pack (a float NaN key, ...): keep the old bytes
            pass
    return data, damage_only


# ---------------------------------------------------------------------------- one case

def intact_tensors(path: Path) -> dict[str, bytes]:
    from tracekit.format import open_bundle

    with open_bundle(path) as reader:
        return {info.name: reader.read_tensor(info.name, to="bytes") for info in reader.tensor_infos()}


def covered_bytes(reader) -> int:
    """Bytes the reader accounts for: header frame, data frames, index frame, trailer."""
    frames = [frame for info in reader.tensor_infos() for chunk in info.chunks for frame in chunk.frames]
    frames.append(reader._index.metadata.frame)
    index_and_trailer = reader._size - (max(frame.offset + frame.stored_nbytes for frame in frames))
    return reader._data_start + sum(frame.stored_nbytes for frame in frames) + index_and_trailer


def padded_parts(path: Path, reader, report) -> list[str]:
    """The parts verify() calls intact whose stored extent holds more than one zstd frame's
    bytes (judged by zstd's own decoder, which stops at the frame's end)."""
    data = path.read_bytes()
    parts = {f"tensor {info.name!r}": [frame for chunk in info.chunks for frame in chunk.frames] for info in reader.tensor_infos()}
    parts["metadata"] = [reader._index.metadata.frame]
    found = []
    for part, frames in parts.items():
        if part in report.damaged:
            continue
        for frame in frames:
            decompressor = zstandard.ZstdDecompressor().decompressobj()
            try:
                decompressor.decompress(data[frame.offset:frame.offset + frame.stored_nbytes])
            except zstandard.ZstdError:
                continue  # damage: verify() should have named it, which check_api's other checks judge
            if decompressor.unused_data:
                found.append(part)
                break
    return found


def header_problem(header) -> bool:
    """Whether a header the reader accepted breaks docs/FORMAT.md's header rules."""
    types = {"magic": str, "format_version": int, "min_reader_version": int, "writer": str}
    if not isinstance(header, dict) or any(key in header and type(header[key]) is not kind for key, kind in types.items()):
        return True
    level, depth = [header], 0
    while level:
        level = [child for value in level for child in (value.values() if isinstance(value, dict) else value)
                 if isinstance(child, (dict, list))]
        depth += bool(level)
    return depth >= 64


def check_api(path: Path, intact: dict[str, bytes], damage_only: bool) -> str:
    from tracekit.errors import BundleError
    from tracekit.format import open_bundle

    try:
        reader = open_bundle(path)
    except BundleError:
        return "refused"
    with reader:
        if covered_bytes(reader) != os.path.getsize(path) or reader._data_start > min(
                [frame.offset for info in reader.tensor_infos() for chunk in info.chunks for frame in chunk.frames]
                + [reader._index.metadata.frame.offset]):
            return "hidden-bytes"
        if header_problem(reader.header):
            return "bad-header"
        report = reader.verify()
        if padded_parts(path, reader, report):
            return "hidden-bytes"
        outcomes = {}
        try:
            metadata = reader.metadata
            outcomes["metadata"] = True
        except BundleError:
            metadata, outcomes["metadata"] = None, False
        for info in reader.tensor_infos():
            part = f"tensor {info.name!r}"
            for verify_hash in (False, True):
                try:
                    data = reader.read_tensor(info.name, to="bytes", verify_hash=verify_hash)
                except BundleError:
                    if report.ok or (verify_hash and part not in report.damaged):
                        return "inconsistent"
                    continue
                if verify_hash and part in report.damaged:
                    return "inconsistent"
                if damage_only and info.name in intact and data != intact[info.name]:
                    return "different-data"
        if report.ok and not outcomes["metadata"] or "metadata" in report.damaged and outcomes["metadata"]:
            return "inconsistent"
        if metadata is not None:
            try:
                reader.resolve(metadata, to="bytes")
            except BundleError as error:
                if report.ok and "memory" not in str(error):
                    return "inconsistent"
    return "read"


def check_cli(path: Path, table: bool, full: bool = False) -> str | None:
    """None if `tracekit inspect --verify` behaved; else what went wrong."""
    args = ["inspect", "--verify", str(path)] + ([] if table else ["--json", "--full"] if full else ["--json"])
    return run_command(args, (0, 2))[1]


def run_command(args: list[str], exit_codes: tuple[int, ...]) -> tuple[str, str | None]:
    """Run `tracekit ARGS` in this process: (how it ended, for the counts: `exit N`; what went
    wrong, None if it behaved: an exit code outside `exit_codes`, an exception other than
    tracekit's one-line error, an error that is not one line, a control character printed)."""
    from click.testing import CliRunner

    from tracekit.cli import main

    result = CliRunner().invoke(main, args, terminal_width=100)
    if result.exit_code not in exit_codes or not isinstance(result.exception, (SystemExit, type(None))):
        return "crash", f"exit {result.exit_code}: {result.exception!r}"
    if result.exit_code in (2, 3):
        lines = result.stderr.splitlines()
        if len(lines) != 1 or not lines[0].startswith("tracekit: error: ") or "Traceback" in result.stderr:
            return "crash", f"error output {result.stderr[:200]!r}"
    if any(char in result.output for char in "\x1b\u202e\x00"):
        return "crash", "unescaped control character in the output"
    return f"exit {result.exit_code}", None


# The commands that read a bundle's metadata, with the exit codes each may end with, run on every
# bundle the reader accepts whose metadata holds recorded content; BUNDLE is the case's bundle,
# SEED the bundle it was mutated from, OUT a file a command may write.
BUNDLE, SEED, OUT = "{bundle}", "{seed}", "{out}"
COMMANDS = {
    "inspect": (["inspect", BUNDLE], (0, 2)),
    "inspect --json --full": (["inspect", "--json", "--full", BUNDLE], (0, 2)),
    "diff": (["diff", BUNDLE, SEED, "--json"], (0, 1, 2)),
    "export": (["export", "-o", "-", BUNDLE], (0, 2)),
    "redact": (["redact", BUNDLE, "-o", OUT, "--force"], (0, 2)),
}
REPLAY = "replay --no-timing, to the engine build"


def replay_until_engine_build(path: Path) -> tuple[str, str | None]:
    """What `tracekit replay --no-timing BUNDLE` does before it builds an engine, by the functions
    it calls (tracekit.cli.replay_command): the bundle opened once; for one rank's part of a
    multi-rank step, finding its set; else the step's facts for its report, then every check of
    `replay` up to the engine build (`tracekit.replay.replayer.checked_before_engine`). (how it
    ended: `reached the engine build`, or the error class refusing it; what went wrong: an
    exception other than tracekit's errors, or an error message of more than one line)."""
    from tracekit.errors import TracekitError
    from tracekit.format.rankset import find_rank_set
    from tracekit.replay.opened import OpenedBundle
    from tracekit.replay.replayer import ReplayOptions, checked_before_engine

    try:
        with OpenedBundle(path) as opened:
            if opened.multi_rank:
                find_rank_set(path).require_complete()
                return "found a whole rank set", None
            opened.facts(None)
            checked_before_engine(opened, ReplayOptions(modes=None))
    except TracekitError as error:
        if "\n" in str(error):
            return "crash", f"a {type(error).__name__} of several lines: {str(error)[:200]!r}"
        return type(error).__name__, None
    except Exception as error:
        return "crash", f"{type(error).__name__}: {error}"
    return "reached the engine build", None


def check_commands(path: Path, seed: Path) -> tuple[dict[str, str], list[str]]:
    """Every command that reads metadata, on one accepted bundle: ({command: how it ended},
    [what went wrong])."""
    outcomes, problems = {}, []
    out = path.with_suffix(".out.zst")
    for name, (args, exit_codes) in COMMANDS.items():
        out.unlink(missing_ok=True)
        outcome, problem = run_command([arg.format(bundle=path, seed=seed, out=out) for arg in args], exit_codes)
        outcomes[name] = outcome
        if problem:
            problems.append(f"{name}: {problem}")
    outcomes[REPLAY], problem = replay_until_engine_build(path)
    if problem:
        problems.append(f"{REPLAY}: {problem}")
    return outcomes, problems


def holds_content(path: Path) -> bool:
    """Whether the bundle's metadata reads and is meant as recorded content."""
    from tracekit.errors import BundleError
    from tracekit.format import open_bundle
    from tracekit.format.schema import BundleContent

    try:
        with open_bundle(path) as reader:
            return BundleContent.claimed_by(reader.metadata)
    except BundleError:
        return False


def case_bundle(case: int, base_seed: int, seeds: list[Path]) -> tuple[Path, bytes, bool]:
    """(the seed, the mutated bytes, whether the mutations were damage only) of case `case`."""
    rng = random.Random(base_seed * 1_000_003 + case)
    seed = rng.choices(seeds, SEED_WEIGHTS)[0]
    return (seed, *mutate(seed.read_bytes(), rng))


def run_case(case: int, base_seed: int, seeds: list[Path], intact: dict, workdir: Path) -> tuple[str, dict[str, str]]:
    """(the case's class, {command: how it ended} when the commands ran)."""
    seed, data, damage_only = case_bundle(case, base_seed, seeds)
    path = workdir / f"case-{case % 64}.zst"
    path.write_bytes(data)
    outcome = check_api(path, intact[seed], damage_only)
    commands = {}
    if outcome == "read" and holds_content(path):
        commands, problems = check_commands(path, seed)
        if problems:
            return "cli-crash", commands
    if outcome in ("refused", "read") and case % 2 == 0:  # the CLI repeats the API's work: every other case
        problem = check_cli(path, table=case % 8 == 0, full=case % 4 == 2)
        if problem:
            return "cli-crash", commands
    return outcome, commands


# ---------------------------------------------------------------------------- processes

def worker(base_seed: int, seed_dir: str, memory_cap: int) -> None:
    """Reads case numbers on stdin, writes '<case> <class> <seconds> <command>=<ending>|...'
    lines on stdout (command endings with spaces as underscores)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))
    seeds = seed_paths(Path(seed_dir))
    intact = {seed: intact_tensors(seed) for seed in seeds}
    workdir = Path(seed_dir) / f"work-{os.getpid()}"
    workdir.mkdir(exist_ok=True)
    for line in sys.stdin:
        case = int(line)
        start = cpu_seconds()
        commands = {}
        try:
            outcome, commands = run_case(case, base_seed, seeds, intact, workdir)
        except MemoryError:
            outcome = "memory"
        except Exception:
            outcome = "foreign"
        endings = "|".join(f"{name}={ending}" for name, ending in commands.items()).replace(" ", "_")
        sys.stdout.write(f"{case} {outcome} {cpu_seconds() - start:.3f} {endings or '-'}\n")
        sys.stdout.flush()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Worker:
    def __init__(self, args, seed_dir: str):
        env = dict(os.environ, MALLOC_ARENA_MAX="2", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", seed_dir, "--seed", str(args.seed), "--memory-gib", str(args.memory_gib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            preexec_fn=lambda: os.nice(args.nice) if args.nice else None,
        )
        self.case = None
        self.started = 0.0

    def give(self, case: int) -> None:
        self.case, self.started = case, time.monotonic()
        self.process.stdin.write(f"{case}\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def fuzz(args) -> dict[str, int]:
    counts = dict.fromkeys(CLASSES, 0)
    command_counts: dict[str, dict[str, int]] = {name: {} for name in [*COMMANDS, REPLAY]}
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
    bad_cases: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="tracekit-fuzz-") as seed_dir:
        write_seeds(Path(seed_dir))
        workers = [Worker(args, seed_dir) for _ in range(args.jobs)]
        started = time.monotonic()
        next_case, done, deadline = args.first_case, 0, started + args.seconds
        idle = list(workers)

        def record(case: int, outcome: str) -> None:
            nonlocal done
            counts[outcome] += 1
            done += 1
            if args.progress and done % args.progress == 0:
                print(f"{done} cases: " + ", ".join(f"{name} {count}" for name, count in counts.items() if count), flush=True)
            if outcome not in FINE or outcome == "slow":
                bad_cases.setdefault(outcome, []).append(case)
                if args.save:  # as they come, so that a long run can be looked into while it runs
                    with open(Path(args.save) / "bad_cases.txt", "a") as listing:
                        listing.write(f"{case} {outcome}\n")

        try:
            while True:
                while idle and time.monotonic() < deadline and (args.cases is None or next_case < args.first_case + args.cases):
                    idle.pop().give(next_case)
                    next_case += 1
                busy = [w for w in workers if w.case is not None]
                if not busy:
                    break
                ready, _, _ = select.select([w.process.stdout for w in busy], [], [], 0.5)
                for w in busy:
                    if w.process.stdout in ready:
                        line = w.process.stdout.readline()
                        if line:
                            case, outcome, seconds, endings = line.split()
                            for entry in endings.split("|") if endings != "-" else []:
                                name, ending = entry.replace("_", " ").split("=")
                                command_counts[name][ending] = command_counts[name].get(ending, 0) + 1
                            if outcome in ("refused", "read") and float(seconds) > args.timeout:
                                outcome = "timeout"
                            elif outcome in ("refused", "read") and float(seconds) > args.slow:
                                outcome = "slow"
                            record(int(case), outcome)
                            w.case = None
                            idle.append(w)
                            continue
                        record(w.case, "memory")  # the worker died: the cap or a signal
                    elif time.monotonic() - w.started < 6 * args.timeout:
                        continue
                    else:
                        record(w.case, "timeout")
                    w.stop()
                    replacement = Worker(args, seed_dir)
                    workers[workers.index(w)] = replacement
                    idle.append(replacement)
        finally:
            for w in workers:
                w.stop()
    print(f"{done} cases in {time.monotonic() - started:.0f} s (numbers {args.first_case}..{next_case - 1}, "
          f"seed {args.seed}, {args.jobs} worker(s))")
    for name in CLASSES:
        print(f"  {name:<16}{counts[name]:>9}" + (f"   e.g. --case {bad_cases[name][0]}" if name in bad_cases else ""))
    with_content = sum(command_counts[REPLAY].values())
    print(f"commands run on the {with_content} accepted bundles holding recorded content (how they ended):")
    for name, endings in command_counts.items():
        print(f"  {name}: " + (", ".join(f"{ending} {count}" for ending, count in sorted(endings.items())) or "none"))
    print(f"tracebacks {counts['foreign'] + counts['cli-crash']}")
    return counts


def replay_case(args) -> None:
    """Run one case in this process and show what happened, with any traceback."""
    with tempfile.TemporaryDirectory(prefix="tracekit-fuzz-") as seed_dir:
        seeds = write_seeds(Path(seed_dir))
        intact = {seed: intact_tensors(seed) for seed in seeds}
        seed, data, damage_only = case_bundle(args.case, args.seed, seeds)
        path = Path(seed_dir) / "case.zst"
        path.write_bytes(data)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            (Path(args.save) / f"case-{args.case}.zst").write_bytes(data)
        print(f"case {args.case}: seed {seed.name}, {len(data)} bytes, damage only: {damage_only}")
        try:
            print("api:", check_api(path, intact[seed], damage_only))
        except BaseException:
            traceback.print_exc()
        print("cli:", check_cli(path, table=True) or "ok", "/", check_cli(path, table=False) or "ok", "/",
              check_cli(path, table=False, full=True) or "ok")
        if holds_content(path):
            for name, (command_args, exit_codes) in COMMANDS.items():
                out = path.with_suffix(".out.zst")
                print(f"{name}:", run_command([arg.format(bundle=path, seed=seed, out=out) for arg in command_args],
                                              exit_codes))
            print(f"{REPLAY}:", replay_until_engine_build(path))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60, help="time budget (default 60)")
    parser.add_argument("--cases", type=int, help="stop after this many cases")
    parser.add_argument("--first-case", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="base seed; a case is (seed, case number)")
    parser.add_argument("--timeout", type=float, default=10, help="CPU seconds after which a case counts as a hang")
    parser.add_argument("--slow", type=float, default=5, help="CPU seconds above which a case counts as slow")
    parser.add_argument("--memory-gib", type=float, default=4, help="RLIMIT_AS of each worker (default 4 GiB)")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the workers")
    parser.add_argument("--progress", type=int, default=0, help="print the counts every N cases")
    parser.add_argument("--save", help="folder for bad_cases.txt (cases other than refused/read) and --case's file")
    parser.add_argument("--case", type=int, help="re-run this one case here and show its traceback")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.seed, args.worker, int(args.memory_gib * (1 << 30)))
    elif args.case is not None:
        replay_case(args)
    else:
        counts = fuzz(args)
        sys.exit(1 if any(counts[name] for name in CLASSES if name not in FINE) else 0)


if __name__ == "__main__":
    main()
