"""traces/golden-v1.zst and golden-v2.zst were each written once by tools/make_golden_bundle.py
(with the tracekit of their format version) and are never rewritten: every future tracekit must
decode both to exactly these values."""

import hashlib
from pathlib import Path

import pytest
import torch

from tracekit.format import open_bundle

TRACES = Path(__file__).resolve().parents[2] / "traces"
VERSIONS = [1, 2]

RAW_SHA256_PREFIX = {
    "dtypes/bool": "877bb339b53a0ac2",
    "dtypes/uint8": "39607e9c17b358ac",
    "dtypes/int8": "4545d7dc47b44a22",
    "dtypes/int16": "8763d89f75e9b575",
    "dtypes/int32": "58bdbef3aad23b92",
    "dtypes/int64": "74064c4a92757b13",
    "dtypes/uint16": "005aeecc04155a14",
    "dtypes/uint32": "56f2bc420889232d",
    "dtypes/uint64": "9e13398f3a47c566",
    "dtypes/float16": "2994838605aa57f3",
    "dtypes/bfloat16": "073bc77b17a77294",
    "dtypes/float32": "10370a5d3d416428",
    "dtypes/float64": "e19a1b0b4a115572",
    "dtypes/complex64": "de0710a945c3a835",
    "dtypes/complex128": "d0d44d687079e950",
    "dtypes/float8_e4m3fn": "7d9dd5406890a17e",
    "dtypes/float8_e4m3fnuz": "80f9998ce2127fec",
    "dtypes/float8_e5m2": "6aaa2a8ebf72c031",
    "dtypes/float8_e5m2fnuz": "3ecb1916fa9b3b03",
    "shapes/scalar": "072e3304b03423a4",
    "shapes/empty": "e3b0c44298fc1c14",
    "kv/layer.0": "e1190345d3576405",
}


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_header_and_layout(version):
    with open_bundle(TRACES / f"golden-v{version}.zst") as reader:
        assert (reader.format_version, reader.min_reader_version) == (version, version)
        assert [info.name for info in reader.tensor_infos()] == list(RAW_SHA256_PREFIX)
        kv = reader.tensor_info("kv/layer.0")
        assert (kv.dtype, kv.shape, kv.nbytes, kv.filter, len(kv.chunks)) == ("bfloat16", (2, 20, 16, 64), 81920, "shuffle", 2)
        assert reader.verify().ok


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_bytes_and_values(version):
    pattern = [[-6, -5, -4, -3], [-2, -1, 0, 1], [2, 3, 4, 5]]
    with open_bundle(TRACES / f"golden-v{version}.zst") as reader:
        for name, prefix in RAW_SHA256_PREFIX.items():
            assert hashlib.sha256(reader.read_tensor(name, to="bytes")).hexdigest()[:16] == prefix, name
        for name in RAW_SHA256_PREFIX:
            dtype_name = name.removeprefix("dtypes/")
            if name.startswith("dtypes/") and dtype_name != "bool":
                values = reader.read_tensor(name, to="torch").to(torch.complex128).real
                expected = [[abs(v) for v in row] for row in pattern] if dtype_name.startswith("uint") else pattern
                assert values.tolist() == expected, name
        assert reader.read_tensor("dtypes/bool").tolist() == [[False, True] * 2] * 3
        assert reader.read_tensor("shapes/scalar").item() == 2.5
        assert reader.read_tensor("shapes/empty", to="numpy").shape == (0, 5)
        kv = reader.read_tensor("kv/layer.0").float().reshape(-1)
        assert kv[:3].tolist() == [-6.0, -5.875, -5.75] and kv[97].item() == -6.0
        assert reader.metadata == {
            "schema": "golden", "format_version": version, "text": "héllo", "blob": b"\x00\x01\xff",
            "numbers": [0, -1, 2**40, 1.5, True, None], "kv": {"$tensor": "kv/layer.0"},
        }
