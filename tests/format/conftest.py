import numpy as np
import pytest
import torch

from tracekit.format import BundleWriter


@pytest.fixture
def small_bundle(tmp_path):
    """A small bundle with a shuffled multi-chunk tensor, a few plain ones and metadata."""
    path = tmp_path / "small.zst"
    with BundleWriter(path, chunk_bytes=16384) as writer:
        ref = writer.add_tensor("kv/layer.0", torch.arange(32768, dtype=torch.float32).remainder(7).to(torch.bfloat16))
        writer.add_tensor("ids", torch.arange(5, dtype=torch.int64))
        writer.add_tensor("mask", np.array([True, False, True]))
        writer.set_metadata({"name": "small", "kv": ref, "numbers": [1, 2.5, None]})
    return path
