"""The closed list of element types a bundle may hold (docs/FORMAT.md, "Element types"), and
the moves between tensors and bytes. A dtype name read from a file is looked up here, never
passed to `getattr(torch, ...)` unchecked; without torch a tensor decodes to numpy, or to bytes
for the dtypes numpy lacks.
"""

import sys
from dataclasses import dataclass

import numpy as np

from tracekit.errors import BundleError


@dataclass(frozen=True)
class DtypeSpec:
    name: str
    itemsize: int
    numpy_name: str | None = None  # None: numpy has no such type; decode to torch or bytes


DTYPES: dict[str, DtypeSpec] = {
    spec.name: spec
    for spec in [
        DtypeSpec("bool", 1, "bool"),
        DtypeSpec("uint8", 1, "uint8"),
        DtypeSpec("int8", 1, "int8"),
        DtypeSpec("int16", 2, "<i2"),
        DtypeSpec("int32", 4, "<i4"),
        DtypeSpec("int64", 8, "<i8"),
        DtypeSpec("uint16", 2, "<u2"),
        DtypeSpec("uint32", 4, "<u4"),
        DtypeSpec("uint64", 8, "<u8"),
        DtypeSpec("float16", 2, "<f2"),
        DtypeSpec("float32", 4, "<f4"),
        DtypeSpec("float64", 8, "<f8"),
        DtypeSpec("complex64", 8, "<c8"),
        DtypeSpec("complex128", 16, "<c16"),
        DtypeSpec("bfloat16", 2),
        DtypeSpec("complex32", 4),
        DtypeSpec("float8_e4m3fn", 1),
        DtypeSpec("float8_e4m3fnuz", 1),
        DtypeSpec("float8_e5m2", 1),
        DtypeSpec("float8_e5m2fnuz", 1),
        DtypeSpec("float8_e8m0fnu", 1),
        DtypeSpec("float4_e2m1fn_x2", 1),
        DtypeSpec("bits8", 1),
        DtypeSpec("bits16", 2),
        DtypeSpec("bits1x8", 1),
        DtypeSpec("bits2x4", 1),
        DtypeSpec("bits4x2", 1),
    ]
}

NUMPY_TO_NAME = {np.dtype(spec.numpy_name): spec.name for spec in DTYPES.values() if spec.numpy_name}


def torch_or_none():
    """torch if it is installed; tracekit.format works without it."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def as_flat_bytes(tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype name, shape, contiguous 1-d uint8 array of the little-endian bytes) of a torch
    tensor on any device or a numpy array or scalar, with any strides."""
    if sys.byteorder != "little":
        raise BundleError("writing bundles needs a little-endian machine")
    if isinstance(tensor, (np.ndarray, np.generic)):
        return _numpy_flat_bytes(np.asarray(tensor))
    torch = torch_or_none()
    if torch is None or not isinstance(tensor, torch.Tensor):
        raise BundleError(f"cannot store a {type(tensor).__name__}: expected a torch.Tensor or numpy array")
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES or tensor.is_quantized or tensor.layout != torch.strided:
        raise BundleError(f"cannot store a tensor of dtype {name} with layout {tensor.layout}")
    cpu = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    return name, tuple(cpu.shape), cpu.reshape(-1).view(torch.uint8).numpy()


def _numpy_flat_bytes(array: np.ndarray) -> tuple[str, tuple[int, ...], np.ndarray]:
    name = NUMPY_TO_NAME.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype)
    if name is None:
        raise BundleError(f"cannot store a numpy array of dtype {array.dtype}")
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return name, tuple(array.shape), little.reshape(-1).view(np.uint8)


def decode(raw: np.ndarray, name: str, shape: tuple[int, ...], to: str):
    """A 1-d uint8 array holding a whole tensor (of a dtype the index checked) as `to` asks for."""
    spec = DTYPES[name]
    if to == "auto":
        to = "torch" if torch_or_none() is not None else ("numpy" if spec.numpy_name else "bytes")
    if to == "bytes":
        return raw.tobytes()
    if to == "numpy":
        if spec.numpy_name is None:
            raise BundleError(f"numpy has no dtype {name}: read it with to='torch' or to='bytes'")
        return raw.view(spec.numpy_name).reshape(shape)
    if to == "torch":
        torch = torch_or_none()
        if torch is None:
            raise BundleError("to='torch' needs torch installed")
        torch_dtype = getattr(torch, name, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise BundleError(f"this torch has no dtype {name}: read it with to='bytes'")
        if raw.nbytes == 0:  # torch cannot view an empty byte tensor as a wider dtype
            return torch.empty(shape, dtype=torch_dtype)
        return torch.from_numpy(raw).view(torch_dtype).reshape(shape)
    raise BundleError(f"unknown target {to!r}: use 'auto', 'torch', 'numpy' or 'bytes'")
