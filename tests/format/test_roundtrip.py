import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracekit.errors import BundleError
from tracekit.format import BundleWriter, open_bundle
from tracekit.format.dtypes import DTYPES

ALL_DTYPES = sorted(DTYPES)


def random_tensor(dtype_name: str, shape, data: bytes) -> torch.Tensor:
    """A tensor of any bit patterns (NaNs included); bool gets 0/1 bytes."""
    dtype = getattr(torch, dtype_name)
    count = int(np.prod(shape)) * dtype.itemsize
    raw = torch.frombuffer(bytearray(data[:count].ljust(count, b"\x01")), dtype=torch.uint8) if count else torch.zeros(0, dtype=torch.uint8)
    if dtype_name == "bool":
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bytes(left: torch.Tensor, right: torch.Tensor) -> bool:
    return left.dtype == right.dtype and left.shape == right.shape and bytes(
        left.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(right.contiguous().reshape(-1).view(torch.uint8).numpy())


tensor_cases = st.tuples(
    st.sampled_from(ALL_DTYPES),
    st.lists(st.integers(0, 5), min_size=0, max_size=4),
    st.binary(min_size=0, max_size=4096),
    st.booleans(),
)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=st.lists(tensor_cases, min_size=1, max_size=4))
def test_every_dtype_and_shape_round_trips(tmp_path_factory, cases):
    path = tmp_path_factory.mktemp("roundtrip") / "b.zst"
    written = {}
    with BundleWriter(path) as writer:
        for number, (dtype_name, shape, data, transpose) in enumerate(cases):
            tensor = random_tensor(dtype_name, shape, data)
            if transpose and tensor.dim() >= 2:
                tensor = tensor.transpose(0, -1)  # non-contiguous input
            written[f"t{number}"] = tensor
            assert writer.add_tensor(f"t{number}", tensor) == {"$tensor": f"t{number}"}
    with open_bundle(path) as reader:
        for name, tensor in written.items():
            loaded = reader.read_tensor(name, to="torch", verify_hash=True)
            assert same_bytes(loaded, tensor), name
            assert reader.read_tensor(name, to="bytes") == bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        assert reader.verify().ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.complex128, torch.float8_e4m3fn])
def test_large_tensors_are_chunked_and_shuffled(tmp_path, dtype):
    # 1e5 elements: never a whole number of 16 KiB chunks, so the last chunk is short
    tensor = random_tensor(str(dtype).removeprefix("torch."), (100_003,), np.random.default_rng(0).bytes(1_600_048))
    path = tmp_path / "big.zst"
    with BundleWriter(path, chunk_bytes=16384, threads=2) as writer:
        writer.add_tensor("big", tensor[::1])
        writer.add_tensor("strided", tensor[::3])
    with open_bundle(path) as reader:
        info = reader.tensor_info("big")
        assert (info.filter == "shuffle") == (dtype.itemsize > 1)
        assert len(info.chunks) == -(-tensor.nbytes // (16384 - 16384 % dtype.itemsize))
        assert same_bytes(reader.read_tensor("big"), tensor)
        assert same_bytes(reader.read_tensor("strided", verify_hash=True), tensor[::3])


def test_numpy_input_and_output(tmp_path):
    arrays = {
        "f4": np.arange(12, dtype=np.float32).reshape(3, 4).T,
        "big_endian": np.arange(6, dtype=">i4"),
        "bool": np.array([[True], [False]]),
        "u8_scalar": np.uint8(7) * np.ones((), dtype=np.uint8),
    }
    with BundleWriter(tmp_path / "n.zst") as writer:
        for name, array in arrays.items():
            writer.add_tensor(name, array)
    with open_bundle(tmp_path / "n.zst") as reader:
        for name, array in arrays.items():
            loaded = reader.read_tensor(name, to="numpy")
            assert loaded.shape == array.shape and np.array_equal(loaded, array)
        assert reader.tensor_info("big_endian").dtype == "int32"


def test_numpy_cannot_hold_bfloat16_but_bytes_can(tmp_path):
    tensor = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    with BundleWriter(tmp_path / "b.zst") as writer:
        writer.add_tensor("x", tensor)
    with open_bundle(tmp_path / "b.zst") as reader:
        with pytest.raises(BundleError, match="numpy has no dtype bfloat16"):
            reader.read_tensor("x", to="numpy")
        assert reader.read_tensor("x", to="bytes") == bytes(tensor.view(torch.uint8).numpy())
        with pytest.raises(BundleError, match="has no tensor 'y'"):
            reader.read_tensor("y")


def test_metadata_round_trips_and_resolves_references(tmp_path):
    tensor = torch.arange(3)
    with BundleWriter(tmp_path / "m.zst") as writer:
        metadata = {"a": [1, -2**63, 2**64 - 1, 1.5, True, None, "é", b"\x00"], "nested": {"t": writer.add_tensor("t", tensor)}}
        writer.set_metadata(metadata)
    with open_bundle(tmp_path / "m.zst") as reader:
        assert reader.metadata == metadata
        assert torch.equal(reader.resolve(reader.metadata)["nested"]["t"], tensor)


def test_writer_refuses_bad_input_with_bundle_errors(tmp_path):
    with BundleWriter(tmp_path / "w.zst") as writer:
        writer.add_tensor("x", torch.zeros(2))
        with pytest.raises(BundleError, match="already in the bundle"):
            writer.add_tensor("x", torch.zeros(2))
        with pytest.raises(BundleError, match="not plain data"):
            writer.set_metadata({"x": object()})
        with pytest.raises(BundleError, match="cannot store a list"):
            writer.add_tensor("y", [1, 2])
        with pytest.raises(BundleError, match="cannot store a numpy array of dtype object"):
            writer.add_tensor("z", np.array([None]))
        writer.add_tensor("still-usable", torch.ones(1))
    with open_bundle(tmp_path / "w.zst") as reader:
        assert [info.name for info in reader.tensor_infos()] == ["x", "still-usable"]
        assert reader.metadata is None


def test_reader_works_without_torch(small_bundle):
    script = f"""
import sys
sys.modules["torch"] = None  # import torch now raises ImportError
from tracekit.format import open_bundle
with open_bundle({str(small_bundle)!r}) as reader:
    ids = reader.read_tensor("ids")
    kv = reader.read_tensor("kv/layer.0")
    assert type(ids).__name__ == "ndarray" and ids.tolist() == [0, 1, 2, 3, 4], ids
    assert isinstance(kv, bytes) and len(kv) == 65536
    assert reader.verify().ok
from tracekit.cli import main
main(["inspect", {str(small_bundle)!r}], standalone_mode=False)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "kv/layer.0" in result.stdout


def test_the_caller_may_overwrite_a_tensor_once_add_tensor_returns(tmp_path):
    # chunks are copied on the writer's threads; add_tensor returns only once all are copied
    generator = torch.Generator().manual_seed(0)
    buffer = torch.empty(40, 1024, dtype=torch.bfloat16)  # 80 KiB: shuffled, 20 chunks of 4 KiB
    written = {}
    path = tmp_path / "reused.zst"
    with BundleWriter(path, chunk_bytes=4096, threads=2) as writer:
        for number in range(4):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
            written[f"t{number}"] = buffer.clone()
            writer.add_tensor(f"t{number}", buffer)  # the next round overwrites it at once, as a recorder does
    with open_bundle(path) as reader:
        for name, tensor in written.items():
            assert same_bytes(reader.read_tensor(name), tensor), name


def test_read_tensors_reads_several_at_once(tmp_path):
    tensors = {f"layer.{n}": torch.randn(3, 50_000, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16) for n in range(3)}
    path = tmp_path / "several.zst"
    with BundleWriter(path, chunk_bytes=65536) as writer:
        for name, tensor in tensors.items():
            writer.add_tensor(name, tensor)
    with open_bundle(path) as reader:
        loaded = reader.read_tensors(["layer.2", "layer.0", "layer.2"])  # order and repeats do not matter
        assert sorted(loaded) == ["layer.0", "layer.2"]
        assert all(same_bytes(loaded[name], tensors[name]) for name in loaded)
        assert reader.read_tensors([]) == {}
        with pytest.raises(BundleError, match="has no tensor 'nope'"):
            reader.read_tensors(["layer.1", "nope"])
