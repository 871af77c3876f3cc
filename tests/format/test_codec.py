"""The writer's per-plane choice of Huffman literals: kept where a plane's byte values are
skewed (float exponents), dropped where they are noise, and never at the cost of size."""

import numpy as np
import torch

from tracekit.format import BundleWriter, open_bundle
from tracekit.format.codec import LITERALS_TRIAL_MIN_BYTES, ChunkEncoder


def test_literals_are_kept_for_skewed_bytes_and_dropped_for_noise():
    rng = np.random.default_rng(0)
    size = LITERALS_TRIAL_MIN_BYTES * 4
    noise = rng.integers(0, 256, size, dtype=np.uint8)
    exponents = (120 + np.clip(rng.normal(0, 2, size), -8, 8)).astype(np.uint8)  # a few values, no long repeats
    noise_with_zero_runs = noise.copy()
    noise_with_zero_runs[: size // 2] = 0
    encoder = ChunkEncoder(None)
    assert encoder.literals_pay(exponents)
    assert not encoder.literals_pay(noise)
    assert not encoder.literals_pay(noise_with_zero_runs)  # runs are matches, not literals
    assert ChunkEncoder(3).literals_pay(noise)  # an explicit zstd level is used as it is
    assert encoder.literals_pay(noise[: LITERALS_TRIAL_MIN_BYTES - 1])  # too small to try


def test_the_choice_costs_no_size_on_floats(tmp_path):
    # bf16: the low byte plane is noise, the high one exponents; dropping literals where they do
    # not pay must leave the bundle as small as Huffman everywhere (within zstd's block overhead)
    tensor = torch.randn(16, 65536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sizes = {}
    for label in ("chosen", "literals everywhere"):
        path = tmp_path / f"{label}.zst"
        writer = BundleWriter(path)
        if label == "literals everywhere":
            writer._encoder.literals_pay = lambda plane: True
        with writer:
            writer.add_tensor("kv", tensor)
        with open_bundle(path) as reader:
            assert torch.equal(reader.read_tensor("kv").view(torch.int16), tensor.view(torch.int16))
            sizes[label] = reader.tensor_info("kv").stored_nbytes
    assert sizes["chosen"] <= sizes["literals everywhere"] * 1.01
    # the exponent plane kept its literals: noise plane ~1.0 plus exponents ~0.35, halved; ~1.0 without
    assert sizes["chosen"] < 0.75 * tensor.numel() * tensor.element_size()
