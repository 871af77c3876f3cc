"""Writes traces/golden-vN.zst (N: the format version written now), a committed bundle that
every future tracekit must read.

Run once when the format version changes (a new golden-vN next to the old ones), never to
"refresh" an existing golden file: tests/format/test_golden.py pins their decoded values, so a
reader change that misreads a v1 or v2 bundle fails there.

    python tools/make_golden_bundle.py [OUTPUT]
"""

import sys

import torch

from tracekit.format import FORMAT_VERSION, BundleWriter

# Integer-valued patterns are exact in every dtype, fp8 and bool included.
DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
]


def golden_tensors() -> dict[str, torch.Tensor]:
    pattern = torch.arange(-6, 6, dtype=torch.float64).reshape(3, 4)
    tensors = {}
    for name in DTYPES:
        values = pattern.remainder(2) if name == "bool" else pattern.abs() if name.startswith("uint") else pattern
        tensors[f"dtypes/{name}"] = values.to(getattr(torch, name))
    tensors["shapes/scalar"] = torch.tensor(2.5, dtype=torch.float32)
    tensors["shapes/empty"] = torch.zeros(0, 5, dtype=torch.int32)
    # 80 KiB of bf16: large enough to be byte-shuffled, split into two chunks
    tensors["kv/layer.0"] = (torch.arange(40960, dtype=torch.float32).remainder(97) / 8 - 6).to(torch.bfloat16).reshape(2, 20, 16, 64)
    return tensors


def main(output: str = f"traces/golden-v{FORMAT_VERSION}.zst") -> None:
    with BundleWriter(output, chunk_bytes=65536) as writer:
        refs = {name: writer.add_tensor(name, tensor) for name, tensor in golden_tensors().items()}
        writer.set_metadata({
            "schema": "golden", "format_version": FORMAT_VERSION, "text": "héllo", "blob": b"\x00\x01\xff",
            "numbers": [0, -1, 2**40, 1.5, True, None], "kv": refs["kv/layer.0"],
        })
    print(f"wrote {output}")


if __name__ == "__main__":
    main(*sys.argv[1:])
