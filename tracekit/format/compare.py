"""Comparing two tensors read from bundles, in numpy: the numbers `tracekit diff` prints.

The definitions are those of `tracekit.numerics.compare_tensors`, computed from a bundle's bytes
without torch, so that `tracekit.format` stays free of it (`tests/format/test_compare.py` checks
that both agree); element types numpy lacks are widened to float64 as torch's `.double()` does,
the packed kinds (float4_e2m1fn_x2, bits*) compared as unsigned integers.
"""

from functools import cache
from typing import Any

import numpy as np

from tracekit.format.dtypes import DTYPES

# name: (exponent bits, mantissa bits, bias, how NaN/inf are encoded)
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),  # no inf; NaN = all exponent and mantissa bits set
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),  # no inf, no -0; NaN = 0x80
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}
FLOATING = {"float16", "float32", "float64", "bfloat16", "float8_e8m0fnu", *_FLOAT8}


@cache
def _float8_table(name: str) -> np.ndarray:
    exponent_bits, mantissa_bits, bias, kind = _FLOAT8[name]
    table = np.empty(256, dtype=np.float64)
    top = (1 << exponent_bits) - 1
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent = (byte >> mantissa_bits) & top
        mantissa = byte & ((1 << mantissa_bits) - 1)
        if kind == "fnuz" and byte == 0x80:
            value = np.nan
        elif kind == "fn" and exponent == top and mantissa == (1 << mantissa_bits) - 1:
            value = np.nan
        elif kind == "ieee" and exponent == top:
            value = np.inf * sign if mantissa == 0 else np.nan
        elif exponent == 0:
            value = sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
        else:
            value = sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)
        table[byte] = value
    return table


def as_float64(raw: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A bundle tensor's bytes as float64 values (what torch's `.double()` gives)."""
    spec = DTYPES[dtype]
    buffer = np.frombuffer(raw, dtype=np.uint8)
    if dtype == "bfloat16":
        values = (buffer.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in _FLOAT8:
        values = _float8_table(dtype)[buffer]
    elif dtype == "float8_e8m0fnu":
        values = np.where(buffer == 0xFF, np.nan, np.exp2(buffer.astype(np.float64) - 127))
    elif dtype == "complex32":
        values = buffer.view("<f2")[0::2]
    elif spec.numpy_name is not None:
        values = buffer.view(spec.numpy_name)
        if values.dtype.kind == "c":
            values = values.real
    else:
        values = buffer.view(f"<u{spec.itemsize}")
    with np.errstate(invalid="ignore"):  # signalling NaN payloads
        return values.astype(np.float64).reshape(shape)


def compare_bytes(actual: bytes, actual_dtype: str, actual_shape, expected: bytes, expected_dtype: str,
                  expected_shape) -> dict[str, Any]:
    """Compare `actual` against the reference `expected`, each given as a bundle tensor's bytes,
    dtype name and shape."""
    actual_shape, expected_shape = tuple(actual_shape), tuple(expected_shape)
    if actual_shape != expected_shape:
        return {"bit_exact": False, "shape_mismatch": [list(actual_shape), list(expected_shape)],
                "max_abs": float("inf"), "relative_rms": float("inf"), "max_abs_vs_rms": float("inf")}
    bit_exact = actual_dtype == expected_dtype and actual == expected
    if int(np.prod(actual_shape, dtype=np.int64)) == 0:
        return {"bit_exact": bit_exact, "max_abs": 0.0, "relative_rms": 0.0, "max_abs_vs_rms": 0.0}
    first, second = as_float64(actual, actual_dtype, actual_shape), as_float64(expected, expected_dtype, expected_shape)
    with np.errstate(all="ignore"):
        delta = first - second
        scale = max(float(np.sqrt(np.mean(np.square(second)))), 1e-12)
        max_abs = float(np.max(np.nan_to_num(np.abs(delta), nan=np.inf)))
        result = {
            "bit_exact": bit_exact,
            "max_abs": max_abs,
            "relative_rms": float(np.sqrt(np.mean(np.square(delta))) / scale),
            "max_abs_vs_rms": max_abs / scale,
        }
    if actual_dtype in FLOATING and len(actual_shape) >= 2 and actual_shape[-1] > 1:
        result["argmax_agreement"] = float(np.mean(_argmax(first) == _argmax(second)))
    return result


def _argmax(values: np.ndarray) -> np.ndarray:
    """argmax along the last dimension, a NaN counting as the largest value (as torch does)."""
    nan = np.isnan(values)
    return np.where(nan.any(axis=-1), nan.argmax(axis=-1), np.argmax(np.where(nan, -np.inf, values), axis=-1))
