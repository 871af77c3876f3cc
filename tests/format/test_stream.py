"""A bundle is one zstd stream of msgpack: `zstd -d` and a plain msgpack reader recover every
tensor and the metadata, following docs/FORMAT.md, with no tracekit code."""

import io
import shutil
import subprocess

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from bundle_forge import read_parts

from tracekit.format import BundleWriter


def reassemble(decompressed: bytes, path) -> tuple[dict, object]:
    """Tensors (as raw bytes) and metadata from the decompressed stream, undoing the shuffle
    where the index says a tensor is shuffled."""
    shuffled = {tensor["name"]: tensor["itemsize"] for tensor in read_parts(path)[1]["tensors"] if tensor["filter"] == "shuffle"}
    chunks, metadata = {}, None
    for item in msgpack.Unpacker(io.BytesIO(decompressed), raw=False, max_buffer_size=1 << 30):
        if "metadata" in item:
            metadata = item["metadata"]
        else:
            chunks.setdefault(item["tensor"], []).append((item["chunk"], item["data"]))
    tensors = {}
    for name, parts in chunks.items():
        itemsize = shuffled.get(name)
        tensors[name] = b"".join(
            np.frombuffer(part, np.uint8).reshape(itemsize, -1).T.tobytes() if itemsize else part for _, part in sorted(parts)
        )
    return tensors, metadata


@pytest.fixture
def mixed_bundle(tmp_path):
    tensors = {
        "kv": torch.randn(2, 65, 16, 8, 8).to(torch.bfloat16),  # 260 KiB: shuffled, the last chunk short
        "ids": torch.arange(7),
        "fp8": torch.ones(3, dtype=torch.float8_e4m3fn),
    }
    path = tmp_path / "m.zst"
    with BundleWriter(path, chunk_bytes=1 << 16) as writer:
        refs = {name: writer.add_tensor(name, tensor) for name, tensor in tensors.items()}
        writer.set_metadata({"refs": refs, "note": "plain"})
    return path, {name: bytes(t.reshape(-1).view(torch.uint8).numpy()) for name, t in tensors.items()}


def test_python_zstd_stream_and_msgpack_recover_everything(mixed_bundle):
    path, expected = mixed_bundle
    reader = zstandard.ZstdDecompressor().stream_reader(path.read_bytes(), read_across_frames=True)
    tensors, metadata = reassemble(reader.read(), path)
    assert tensors == expected
    assert metadata == {"refs": {name: {"$tensor": name} for name in expected}, "note": "plain"}


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd command line tool is not installed")
def test_zstd_command_line_decompresses_a_bundle(mixed_bundle):
    path, expected = mixed_bundle
    decompressed = subprocess.run(["zstd", "-d", "-c", str(path)], capture_output=True, check=True).stdout
    tensors, metadata = reassemble(decompressed, path)
    assert tensors == expected and metadata["note"] == "plain"
