"""Damaged, forged and hostile files: each must give one clear BundleError and nothing else."""

import subprocess
import sys

import msgpack
import pytest
import zstandard
from bundle_forge import forge, read_parts

from tracekit.errors import BundleError
from tracekit.format import open_bundle


def read_everything(path, intact: dict) -> dict:
    """Open and decode every part, raising only BundleError; returns verify's damaged parts.
    A damaged part fails a hash-checked read; a plain read fails too or returns intact bytes
    (a flip that zstd ignores, in an unused header bit say, leaves the content intact)."""
    with open_bundle(path) as reader:
        report = reader.verify()
        for info in reader.tensor_infos():
            part = f"tensor {info.name!r}"
            if part in report.damaged:
                with pytest.raises(BundleError, match=f"is damaged: {part}"):
                    reader.read_tensor(info.name, verify_hash=True)
            try:
                assert reader.read_tensor(info.name, to="bytes") == intact[info.name]
            except BundleError as error:
                assert part in report.damaged and f"is damaged: {part}" in str(error)
        if "metadata" in report.damaged:
            with pytest.raises(BundleError, match="is damaged: metadata"):
                reader.metadata
        try:  # all at once, as resolve reads: every tensor intact, or a damaged one named
            together = reader.read_tensors(list(intact), to="bytes")
            assert together == intact
        except BundleError as error:
            assert any(f"is damaged: {part}" in str(error) for part in report.damaged), error
        return report.damaged


def intact_tensors(path) -> dict:
    with open_bundle(path) as reader:
        return {info.name: reader.read_tensor(info.name, to="bytes") for info in reader.tensor_infos()}


def test_intact_bundle_has_no_damage(small_bundle):
    assert read_everything(small_bundle, intact_tensors(small_bundle)) == {}


def test_every_truncation_is_refused(small_bundle, tmp_path):
    data = small_bundle.read_bytes()
    cut_path = tmp_path / "cut.zst"
    for length in range(len(data)):
        cut_path.write_bytes(data[:length])
        with pytest.raises(BundleError, match="is damaged|is not a tracekit bundle"):
            open_bundle(cut_path)


def test_every_flipped_bit_is_detected_and_located(small_bundle, tmp_path):
    data = small_bundle.read_bytes()
    _, index, _ = read_parts(small_bundle)
    frame_owner = {}
    for tensor in index["tensors"]:
        for chunk in tensor["chunks"]:
            for offset, stored, *_ in chunk["frames"]:
                frame_owner.update({position: f"tensor {tensor['name']!r}" for position in range(offset, offset + stored)})
    flipped_path = tmp_path / "flipped.zst"
    intact = intact_tensors(small_bundle)
    for position in range(len(data)):
        flipped = bytearray(data)
        flipped[position] ^= 1 << (position % 8)
        flipped_path.write_bytes(bytes(flipped))
        try:
            damaged = read_everything(flipped_path, intact)
        except BundleError as error:
            assert "is damaged" in str(error) or "not a tracekit bundle" in str(error)
            assert position not in frame_owner, f"a flip in {frame_owner.get(position)} should not stop opening"
            continue
        assert damaged, f"flip at byte {position} went unnoticed"
        if position in frame_owner:
            assert list(damaged) == [frame_owner[position]]


def test_forged_huge_tensor_size_is_refused(small_bundle, tmp_path):
    def huge(index):
        index["tensors"][1]["nbytes"] = 2**50
        index["tensors"][1]["shape"] = [2**47]

    forge(small_bundle, tmp_path / "huge.zst", edit_index=huge)
    with pytest.raises(BundleError, match="is damaged: index is malformed: tensor 'ids' 'nbytes' is 1125899906842624, outside"):
        open_bundle(tmp_path / "huge.zst")


def test_forged_chunk_and_metadata_sizes_are_refused(small_bundle, tmp_path):
    def big_chunk(index):
        index["tensors"][0]["chunks"][0]["nbytes"] = 2**40

    def big_metadata(index):
        index["metadata"]["frame"][2] = 2**40

    for edit, message in [(big_chunk, "chunk 0 'nbytes' is 1099511627776, outside"), (big_metadata, "metadata declares")]:
        forge(small_bundle, tmp_path / "forged.zst", edit_index=edit)
        with pytest.raises(BundleError, match=message):
            open_bundle(tmp_path / "forged.zst")


@pytest.mark.parametrize("write_content_size", [True, False])
def test_zip_bomb_frame_is_refused_before_decompressing(small_bundle, tmp_path, write_content_size):
    bomb = zstandard.ZstdCompressor(write_checksum=True, write_content_size=write_content_size).compress(bytes(512 << 20))
    assert len(bomb) < 64 << 10
    forge(small_bundle, tmp_path / "bomb.zst", frames={("ids", 0, 0): bomb})
    with open_bundle(tmp_path / "bomb.zst") as reader:
        with pytest.raises(BundleError, match="tensor 'ids' (claims|frame declares)"):
            reader.read_tensor("ids")
        assert set(reader.verify().damaged) == {"tensor 'ids'"}


def test_forged_expansion_beyond_what_zstd_can_encode_is_refused(small_bundle, tmp_path):
    _, index, _ = read_parts(small_bundle)
    tiny = zstandard.ZstdCompressor(write_checksum=True).compress(b"x")

    def claim_more(index):
        index["metadata"]["frame"][2] = 1 << 25

    forge(small_bundle, tmp_path / "claim.zst", frames={("metadata",): tiny}, edit_index=claim_more)
    with open_bundle(tmp_path / "claim.zst") as reader, pytest.raises(BundleError, match="metadata claims 33554432 bytes"):
        reader.metadata


def test_bundle_from_a_future_format_is_refused_clearly(small_bundle, tmp_path):
    def future(header):
        header.update(format_version=3, min_reader_version=3)

    forge(small_bundle, tmp_path / "future.zst", edit_header=future)
    with pytest.raises(BundleError, match=r"needs reader version >= 3; this tracekit reads format <= 2: upgrade tracekit"):
        open_bundle(tmp_path / "future.zst")


def test_unknown_fields_from_a_newer_minor_version_are_ignored(small_bundle, tmp_path):
    def newer_header(header):
        header.update(format_version=2, compression_dictionary="later", extra={"a": 1})

    def newer_index(index):
        index["new_section"] = [1, 2, 3]
        index["tensors"][0]["quantization"] = {"scale": 0.5}
        index["tensors"][0]["chunks"][0]["xxh3"] = b"12345678"

    forge(small_bundle, tmp_path / "newer.zst", edit_header=newer_header, edit_index=newer_index)
    with open_bundle(tmp_path / "newer.zst") as reader:
        assert reader.format_version == 2
        assert reader.metadata["name"] == "small"
        assert reader.verify().ok


@pytest.mark.parametrize("content", [b"", b"hello world", zstandard.ZstdCompressor().compress(msgpack.packb({"a": 1}))])
def test_files_that_are_not_bundles(tmp_path, content):
    (tmp_path / "x.zst").write_bytes(content)
    with pytest.raises(BundleError, match="is not a tracekit bundle"):
        open_bundle(tmp_path / "x.zst")


def test_missing_file(tmp_path):
    with pytest.raises(BundleError, match="cannot open bundle .*No such file"):
        open_bundle(tmp_path / "absent.zst")


def run_cli(*args):
    return subprocess.run([sys.executable, "-c", "from tracekit.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_cli_on_bad_files_exits_2_with_one_line(small_bundle, tmp_path):
    data = small_bundle.read_bytes()
    (tmp_path / "cut.zst").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[200] ^= 0x10  # inside the first tensor's frames
    (tmp_path / "flipped.zst").write_bytes(bytes(flipped))
    forge(small_bundle, tmp_path / "future.zst", edit_header=lambda header: header.update(min_reader_version=9))
    cases = [
        (["inspect", tmp_path / "cut.zst"], "is damaged: trailer"),
        (["inspect", tmp_path / "future.zst"], "needs reader version >= 9"),
        (["inspect", "--verify", tmp_path / "flipped.zst"], "is damaged: tensor 'kv/layer.0'"),
        (["inspect", tmp_path / "absent.zst"], "cannot open bundle"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("tracekit: error: "), result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr
