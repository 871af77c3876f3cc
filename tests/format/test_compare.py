"""`tracekit diff` compares in numpy (tracekit.format.compare); its numbers must equal those of
tracekit.numerics.compare_tensors, the torch definition the rest of tracekit uses."""

import math

import pytest
import torch

from tracekit.format.compare import as_float64, compare_bytes
from tracekit.format.dtypes import as_flat_bytes
from tracekit.numerics import compare_tensors


def both(actual: torch.Tensor, expected: torch.Tensor) -> tuple[dict, dict]:
    def described(tensor):
        dtype, shape, flat = as_flat_bytes(tensor)
        return flat.tobytes(), dtype, shape

    return compare_bytes(*described(actual), *described(expected)), compare_tensors(actual, expected)


def assert_same(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert ours[key] == pytest.approx(value, rel=1e-9, abs=0) or (math.isnan(value) and math.isnan(ours[key])), key
        else:
            assert ours[key] == value, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.uint8, torch.bool, torch.complex64])
def test_numbers_equal_the_torch_definition(dtype):
    generator = torch.Generator().manual_seed(0)
    base = torch.randn((6, 9), generator=generator) * 3
    other = base + torch.randn((6, 9), generator=generator) * 0.2
    if dtype == torch.bool:
        first, second = base > 0, other > 0
    else:
        first, second = base.to(dtype), other.to(dtype)
    assert_same(*both(first, second))
    assert_same(*both(first, first.clone()))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                                   torch.float8_e8m0fnu, torch.bfloat16])
def test_every_byte_pattern_widens_as_torch_does(dtype):
    """torch has no argmax for float8, so compare_tensors cannot run on it; the widening to
    float64 that both definitions start from is checked for every byte pattern instead."""
    patterns = torch.arange(256 ** dtype.itemsize, dtype=torch.int32).to(torch.uint8 if dtype.itemsize == 1 else torch.int16)
    values = patterns.view(dtype)
    dtype_name, shape, flat = as_flat_bytes(values)
    ours = torch.from_numpy(as_float64(flat.tobytes(), dtype_name, shape))
    assert torch.equal(ours.isnan(), values.double().isnan())
    assert torch.equal(ours.nan_to_num(), values.double().nan_to_num())


def test_nan_inf_shape_mismatch_and_empty():
    with_specials = torch.tensor([[1.0, float("nan"), 2.0], [float("inf"), 0.0, -1.0]])
    assert_same(*both(with_specials, torch.ones((2, 3))))
    assert_same(*both(torch.ones((2, 3)), torch.ones((3, 2))))
    assert_same(*both(torch.ones((0, 3)), torch.ones((0, 3))))
