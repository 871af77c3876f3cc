"""Hostile bundles found by tools/fuzz_bundle.py and listed in issue 11: each gives a BundleError
(or, for `tracekit inspect`, exit 2 with one line), never a crash, a hang, a memory blow-up or
bytes other than those written."""

import hashlib
import os
import struct
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import zstandard
from bundle_forge import forge, frame_refs, read_parts
from click.testing import CliRunner

import tracekit.format.reader
from tracekit.cli import main
from tracekit.errors import BundleError
from tracekit.format import BundleWriter, limits, open_bundle

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "..", "traces", "golden-v1.zst")


def forge_metadata(source, target, content: bytes) -> None:
    """`source` with its metadata frame replaced by `content`, every hash redone."""
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(content)

    def point_at(index):
        index["metadata"]["frame"][2] = len(content)
        index["metadata"]["sha256"] = hashlib.sha256(content).digest()

    forge(source, target, frames={("metadata",): frame}, edit_index=point_at)


def packed_array_of(item: bytes, count: int) -> bytes:
    return b"\x81\xa8metadata" + b"\xdd" + struct.pack(">I", count) + item * count


@pytest.mark.parametrize("depth", [limits.MAX_METADATA_DEPTH + 1, 1000, 5000])
def test_deeply_nested_metadata_is_refused(small_bundle, tmp_path, depth):
    forge_metadata(small_bundle, tmp_path / "deep.zst", b"\x81\xa8metadata" + b"\x91" * depth + b"\xc0")
    with open_bundle(tmp_path / "deep.zst") as reader:
        with pytest.raises(BundleError, match="unacceptable metadata: it (is nested more than 64 deep|is not readable)"):
            reader.metadata
        assert "metadata" in reader.verify().damaged
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "deep.zst")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1


def test_metadata_at_the_depth_cap_is_read(small_bundle, tmp_path):
    forge_metadata(small_bundle, tmp_path / "deep.zst", b"\x81\xa8metadata" + b"\x91" * (limits.MAX_METADATA_DEPTH - 1) + b"\x90")
    with open_bundle(tmp_path / "deep.zst") as reader:
        assert reader.resolve(reader.metadata) == reader.metadata


def test_the_writer_refuses_metadata_a_reader_would_refuse(tmp_path):
    deep = []
    for _ in range(limits.MAX_METADATA_DEPTH):
        deep = [deep]
    with BundleWriter(tmp_path / "deep.zst") as writer:
        with pytest.raises(BundleError, match="metadata cannot be stored: it is nested more than 64 deep"):
            writer.set_metadata(deep)
        writer.set_metadata(deep[0])  # at the cap: fine
    with open_bundle(tmp_path / "deep.zst") as reader:
        assert reader.metadata == deep[0]


def test_many_references_to_one_tensor_read_it_once(small_bundle, tmp_path, monkeypatch):
    count = 20_000
    forge_metadata(small_bundle, tmp_path / "refs.zst", packed_array_of(msgpack.packb({"$tensor": "kv/layer.0"}), count))
    decoded = []
    real_decode = tracekit.format.reader.decode_chunk
    monkeypatch.setattr(tracekit.format.reader, "decode_chunk", lambda *args: decoded.append(1) or real_decode(*args))
    with open_bundle(tmp_path / "refs.zst") as reader:
        resolved = reader.resolve(reader.metadata, to="bytes")
        chunks = len(reader.tensor_info("kv/layer.0").chunks)
    assert len(resolved) == count and all(item is resolved[0] for item in resolved)
    assert len(decoded) == chunks  # one read of the tensor, whatever the number of references


def test_too_many_references_are_refused(small_bundle, tmp_path):
    forge_metadata(small_bundle, tmp_path / "refs.zst",
                   packed_array_of(msgpack.packb({"$tensor": "ids"}), limits.MAX_TENSOR_REFERENCES + 1))
    with open_bundle(tmp_path / "refs.zst") as reader, pytest.raises(BundleError, match="more than 100000 tensor references"):
        reader.metadata


@pytest.mark.parametrize("item, message", [(b"\x80", "maps and arrays"), (b"\x00", "entries")])
def test_metadata_that_unpacks_to_millions_of_objects_is_refused(small_bundle, tmp_path, item, message):
    # 16 MiB of 1-byte empty maps (1 GiB as Python dicts) or of small ints, in 8 arrays each
    # under msgpack's own per-array limit: a few KiB of zstd
    part = b"\xdd" + struct.pack(">I", 2 << 20) + item * (2 << 20)
    forge_metadata(small_bundle, tmp_path / "bomb.zst", b"\x81\xa8metadata\x98" + part * 8)
    assert os.path.getsize(tmp_path / "bomb.zst") < 64 << 10
    with open_bundle(tmp_path / "bomb.zst") as reader, pytest.raises(BundleError, match=f"more than .* {message}"):
        reader.metadata


def test_extension_types_and_dangling_references_are_refused(small_bundle, tmp_path):
    for content, message in [
        (msgpack.packb({"metadata": [msgpack.ExtType(5, b"xx")]}), "extension type"),
        (msgpack.packb({"metadata": {"$tensor": "absent"}}), "refers to tensor 'absent'"),
        (msgpack.packb({"no metadata": 1}), "has no 'metadata' entry"),
    ]:
        forge_metadata(small_bundle, tmp_path / "odd.zst", content)
        with open_bundle(tmp_path / "odd.zst") as reader, pytest.raises(BundleError, match=message):
            reader.metadata


def test_frames_listed_out_of_file_order_are_refused(small_bundle, tmp_path):
    def reverse_planes(index):
        index["tensors"][0]["chunks"][0]["frames"].reverse()

    forge(small_bundle, tmp_path / "reordered.zst", edit_index=reverse_planes)
    with pytest.raises(BundleError, match="index is malformed: .*(frame sizes|gap or overlap)"):
        open_bundle(tmp_path / "reordered.zst")


@pytest.mark.parametrize("junk", [b"\0", zstandard.ZstdCompressor(write_checksum=True).compress(b"hidden")])
def test_bytes_between_data_frames_are_refused(small_bundle, tmp_path, junk):
    forge(small_bundle, tmp_path / "hidden.zst", hidden={("ids", 0, 0): junk})
    with pytest.raises(BundleError, match="index is malformed: frames leave a gap or overlap"):
        open_bundle(tmp_path / "hidden.zst")


def test_more_frames_than_the_cap_are_refused_before_anything_else(small_bundle, tmp_path):
    def many_chunks(index):
        chunk = index["tensors"][1]["chunks"][0]
        index["tensors"][1]["chunks"] = [chunk] * (limits.MAX_FRAMES + 1)

    forge(small_bundle, tmp_path / "chunks.zst", edit_index=many_chunks)
    with pytest.raises(BundleError, match=f"more than {limits.MAX_FRAMES} frames"):
        open_bundle(tmp_path / "chunks.zst")


def test_an_unknown_dtype_is_refused_by_open_so_verify_and_read_agree(small_bundle, tmp_path):
    forge(small_bundle, tmp_path / "dtype.zst", edit_index=lambda index: index["tensors"][1].update(dtype="uint8../../etc/passwd"))
    with pytest.raises(BundleError, match="tensor 'ids' has unknown dtype 'uint8../../etc/passwd'"):
        open_bundle(tmp_path / "dtype.zst")


def equal_size_frame_pairs(path) -> list[tuple[list, list]]:
    _, index, _ = read_parts(path)
    frames = [frame for tensor in index["tensors"] for chunk in tensor["chunks"] for frame in chunk["frames"]]
    return [(a, b) for i, a in enumerate(frames) for b in frames[i + 1:] if a[1] == b[1]]


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("source", ["noise", "golden-v1"])
def test_frames_swapped_or_copied_are_caught_by_plain_reads(tmp_path, swap, source):
    """Each frame is intact by itself (zstd's own checksum holds), only misplaced: a plain read
    must notice (v2: the index's copy of each frame's checksum; v1: the CRC-32)."""
    if source == "noise":  # random int16: the noise planes of its chunks are stored raw, equal in size
        path = tmp_path / "noise.zst"
        with BundleWriter(path, chunk_bytes=1 << 16) as writer:
            writer.add_tensor("noise", np.random.default_rng(0).integers(-2**15, 2**15, 1 << 16, dtype=np.int16))
    else:
        path = tmp_path / "golden.zst"
        path.write_bytes(open(GOLDEN, "rb").read())
    with open_bundle(path) as reader:
        intact = {info.name: reader.read_tensor(info.name, to="bytes") for info in reader.tensor_infos()}
    pairs = equal_size_frame_pairs(path)
    assert pairs  # derived from the data: the planes of equal-size chunks, or the golden file's small tensors
    data = bytearray(path.read_bytes())
    for first, second in pairs[:20]:
        mutated = bytearray(data)
        a, b = bytes(data[first[0]:first[0] + first[1]]), bytes(data[second[0]:second[0] + second[1]])
        if a == b:
            continue
        mutated[second[0]:second[0] + second[1]] = a
        if swap:
            mutated[first[0]:first[0] + first[1]] = b
        (tmp_path / "mutated.zst").write_bytes(bytes(mutated))
        with open_bundle(tmp_path / "mutated.zst") as reader:
            damaged = reader.verify().damaged
            assert damaged
            for info in reader.tensor_infos():
                try:
                    assert reader.read_tensor(info.name, to="bytes") == intact[info.name]
                except BundleError as error:
                    assert f"tensor {info.name!r}" in damaged and "is damaged" in str(error)


def test_metadata_and_verify_agree_on_a_forged_frame_crc(small_bundle, tmp_path):
    """Found by the fuzzer (case 9942, seed 0): an index re-signed with a wrong CRC-32 for the
    intact metadata frame failed verify() but read fine; metadata reads now run every check."""
    forge(small_bundle, tmp_path / "crc.zst", edit_index=lambda index: index["metadata"]["frame"].__setitem__(3, 0))
    with open_bundle(tmp_path / "crc.zst") as reader:
        assert list(reader.verify().damaged) == ["metadata"]
        with pytest.raises(BundleError, match="is damaged: metadata is altered on disk"):
            reader.metadata


def test_a_fifo_or_a_folder_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "fifo.zst")  # opening it for reading would block until a writer came
    for path in (tmp_path / "fifo.zst", tmp_path):
        with pytest.raises(BundleError, match="not a regular file"):
            open_bundle(path)


def test_index_length_must_match_the_trailer(small_bundle, tmp_path):
    data = bytearray(small_bundle.read_bytes())
    _, index_offset, _, _ = struct.unpack_from("<8sQQ32s", data, len(data) - 56)
    struct.pack_into("<I", data, index_offset + 4, struct.unpack_from("<I", data, index_offset + 4)[0] - 1)
    (tmp_path / "short.zst").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="is damaged: index"):
        open_bundle(tmp_path / "short.zst")


HOSTILE_NAMES = ["[/]", "[bold red]red[/]", "\x1b[2J\x1b[31mred", "\u202eevil", "two\nlines"]


def test_inspect_shows_markup_and_escape_sequences_literally(tmp_path):
    path = tmp_path / "names.zst"
    with BundleWriter(path) as writer:
        for name in HOSTILE_NAMES:
            writer.add_tensor(name, np.arange(3))
        writer.set_metadata({"note": HOSTILE_NAMES})
    result = CliRunner().invoke(main, ["inspect", "--verify", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\u202e" not in result.output
    for shown in ["[/]", "[bold red]red[/]", "\\u001b[2J\\u001b[31mred", "\\u202eevil", "two\\u000alines"]:
        assert shown in result.output, shown


def test_inspect_lists_a_huge_index_in_bounded_time(tmp_path):
    count = 2 * 200 + 1  # more than twice the table's rows: the rest is summarized in one line
    path = tmp_path / "many.zst"
    with BundleWriter(path) as writer:
        for number in range(count):
            writer.add_tensor(f"t{number}", np.zeros(0, dtype=np.int8))
    result = CliRunner().invoke(main, ["inspect", str(path)], terminal_width=200)
    assert result.exit_code == 0 and f"... and {count - 200} more tensors (--json lists all)" in result.output


NO_TORCH = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Blocker())
from tracekit.cli import main
main()
"""


def test_inspect_and_diff_work_without_torch_or_vllm(small_bundle):
    for args in (["inspect", "--verify", str(small_bundle)], ["diff", str(small_bundle), str(small_bundle), "--json"]):
        result = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "torch" not in result.stderr
    blocked = subprocess.run([sys.executable, "-c", NO_TORCH.replace("from tracekit.cli import main\nmain()", "import torch")],
                             capture_output=True, text=True, timeout=60)
    assert "torch is blocked in this test" in blocked.stderr  # the blocker works


def nested_list(depth: int) -> bytes:
    """A msgpack list nested `depth` deep (msgpack.packb stops at 511)."""
    return b"\x91" * (depth - 1) + b"\x90"


def header_with(key: str, packed_value: bytes):
    """A pack_header for forge(): the source header with `key` set to the msgpack bytes given."""
    def pack(header):
        others = {name: value for name, value in header.items() if name != key}
        return (bytes([0x80 | len(others) + 1]) + b"".join(msgpack.packb(name) + msgpack.packb(value) for name, value in others.items())
                + msgpack.packb(key) + packed_value)
    return pack


@pytest.mark.parametrize("key, value, message", [
    ("writer", nested_list(1000), "header is nested more than 64 deep"),
    ("writer", nested_list(limits.MAX_METADATA_DEPTH + 1), "header is nested more than 64 deep"),
    ("added_later", nested_list(1000), "header is nested more than 64 deep"),
    ("writer", msgpack.packb(["tracekit 0.1.0"]), "header field 'writer' is a list, not a str"),
    ("writer", msgpack.packb({"name": "tracekit"}), "header field 'writer' is a map, not a str"),
    ("writer", msgpack.packb(7), "header field 'writer' is an int, not a str"),
    ("magic", msgpack.packb(["tracekit.bundle"]), "is not a tracekit bundle"),
], ids=["writer-1000-deep", "writer-65-deep", "unknown-1000-deep", "writer-list", "writer-map", "writer-int", "magic-list"])
def test_a_header_field_of_the_wrong_type_or_nested_too_deep_is_refused(small_bundle, tmp_path, key, value, message):
    """Issue 18: a `writer` nested 1000 deep passed the reader and crashed `tracekit inspect`
    (RecursionError, exit 1); the header now has the metadata's type and depth checks."""
    forge(small_bundle, tmp_path / "header.zst", pack_header=header_with(key, value))
    with pytest.raises(BundleError, match=message):
        open_bundle(tmp_path / "header.zst")
    for args in (["inspect", str(tmp_path / "header.zst")], ["inspect", "--json", "--full", str(tmp_path / "header.zst")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert result.stderr.count("\n") == 1 and message.split(" is ")[0] in result.stderr, result.stderr


def test_a_future_header_is_refused_by_version_before_its_fields_are_judged(small_bundle, tmp_path):
    def future(header):
        header.update(format_version=3, min_reader_version=3, writer={"name": "tracekit", "version": "9"})

    forge(small_bundle, tmp_path / "future.zst", edit_header=future)
    with pytest.raises(BundleError, match="needs reader version >= 3; .*: upgrade tracekit"):
        open_bundle(tmp_path / "future.zst")


def test_header_fields_of_the_right_types_and_unknown_ones_are_read(small_bundle, tmp_path):
    def newer(header):
        header.update(added_later={"a": [[1, 2], {"b": None}]})

    forge(small_bundle, tmp_path / "newer.zst", edit_header=newer)
    forge(small_bundle, tmp_path / "no-writer.zst", edit_header=lambda header: header.pop("writer"))
    with open_bundle(tmp_path / "newer.zst") as reader:
        assert reader.header["writer"].startswith("tracekit ") and reader.verify().ok
    with open_bundle(tmp_path / "no-writer.zst") as reader:  # informational: a writer may leave it out
        assert "writer" not in reader.header and reader.verify().ok


EMPTY_ZSTD_FRAME = zstandard.ZstdCompressor(write_checksum=True).compress(b"")


@pytest.mark.parametrize("junk", [b"\0", bytes(range(32)), b"\x28\xb5\x2f\xfd", EMPTY_ZSTD_FRAME],
                         ids=["1-byte", "32-bytes", "zstd-magic", "empty-zstd-frame"])
@pytest.mark.parametrize("part", ["metadata", "tensor 'ids'", "golden-v1 metadata"])
def test_bytes_after_a_frame_inside_its_indexed_extent_are_refused(small_bundle, tmp_path, part, junk):
    """Issue 18: junk after the metadata frame, inside the extent the index gives it (re-signed:
    CRC-32, and in v2 the checksum, over the padded bytes), was accepted and `verify` said all
    parts intact; a tensor frame took an empty zstd frame after it. Frames tile exactly."""
    source = GOLDEN if part.startswith("golden") else small_bundle
    key = ("ids", 0, 0) if part == "tensor 'ids'" else ("metadata",)
    _, index, data = read_parts(source)
    ref = frame_refs(index)[key]
    forge(source, tmp_path / "padded.zst", frames={key: data[ref[0]:ref[0] + ref[1]] + junk})
    problem = f"has {len(junk)} bytes after the end of its zstd frame"
    name = part.removeprefix("golden-v1 ")
    with open_bundle(tmp_path / "padded.zst") as reader:
        damaged = reader.verify().damaged
        assert list(damaged) == [name] and problem in damaged[name], damaged
        with pytest.raises(BundleError, match=f"is damaged: {name} {problem}"):
            reader.metadata if name == "metadata" else reader.read_tensor("ids")
    result = CliRunner().invoke(main, ["inspect", "--verify", str(tmp_path / "padded.zst")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and problem in result.stderr, result.stderr


def test_maps_that_only_look_like_references_do_not_count_against_the_reference_cap(small_bundle, tmp_path):
    """`{"$tensor": 1}` names no tensor: it is a plain map, for the unpacker's count as for the rest."""
    count = limits.MAX_TENSOR_REFERENCES + 1
    forge_metadata(small_bundle, tmp_path / "lookalikes.zst", packed_array_of(msgpack.packb({"$tensor": 1}), count))
    with open_bundle(tmp_path / "lookalikes.zst") as reader:
        assert reader.metadata == [{"$tensor": 1}] * count


def test_rewrite_refuses_metadata_left_referring_to_a_dropped_tensor(small_bundle, tmp_path):
    from tracekit.format.rewrite import rewrite_bundle

    def drop(metadata, tensors):
        del tensors["kv/layer.0"]
        metadata["odd"] = {"$tensor": ["kv/layer.0"]}  # not a reference: fine

    with pytest.raises(BundleError, match=r"edited metadata refers to tensors it no longer has: \['kv/layer.0'\]"):
        rewrite_bundle(small_bundle, tmp_path / "dropped.zst", drop)
    rewrite_bundle(small_bundle, tmp_path / "kept.zst", lambda metadata, tensors: metadata.update(kv={"$tensor": ["x"]}))
    with open_bundle(tmp_path / "kept.zst") as reader:
        assert reader.metadata["kv"] == {"$tensor": ["x"]}
