"""Benchmark: a tracekit bundle against torch.save/torch.load, safetensors and naive
zstd(msgpack), writing and reading the same KV-cache-like tensors in one run.

Data sets (each --mib MiB, split into 16 per-layer tensors shaped like vLLM's KV cache
[2, blocks, 16 tokens, 8 heads, 128 dims]):
  random  standard normal values
  kv-mix  60% of blocks hold keys/values with per-channel scales and a few outlier channels
          (as real keys have), 40% are never-used zero blocks
in bfloat16 and float32. Every writer fsyncs its file so that all pay for durability alike;
reads come from the page cache. Prints throughput (MiB/s of tensor bytes), file size, and
tracekit's ratios to torch.save/torch.load. Keep it to one run on a shared machine.

    python tools/bench_bundle.py [--mib 256] [--repeats 2] [--dir /tmp]
"""

import argparse
import os
import tempfile
import time

import msgpack
import numpy as np
import safetensors.torch
import torch
import zstandard

from tracekit.format import BundleWriter, open_bundle

LAYERS = 16
BLOCK_SHAPE = (16, 8, 128)


def kv_tensors(kind: str, dtype: torch.dtype, total_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    block_bytes = 2 * int(np.prod(BLOCK_SHAPE)) * dtype.itemsize
    blocks = max(1, total_mib * (1 << 20) // LAYERS // block_bytes)
    tensors = {}
    for layer in range(LAYERS):
        values = torch.randn((2, blocks, *BLOCK_SHAPE), generator=generator)
        if kind == "kv-mix":
            channel_scale = torch.exp(0.5 * torch.randn((2, 1, 1, *BLOCK_SHAPE[1:]), generator=generator))
            channel_scale[0, ..., :4] *= 20  # a few outlier key channels
            values *= channel_scale
            values[:, torch.rand(blocks, generator=generator) < 0.4] = 0
        tensors[f"kv/layer.{layer}"] = values.to(dtype)
    return tensors


def fsync_path(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    os.fsync(descriptor)
    os.close(descriptor)


def tracekit_write(tensors, path):
    with BundleWriter(path) as writer:
        for name, tensor in tensors.items():
            writer.add_tensor(name, tensor)


def tracekit_read(path):
    with open_bundle(path) as reader:
        return {info.name: reader.read_tensor(info.name, to="torch") for info in reader.tensor_infos()}


def torch_write(tensors, path):
    torch.save(tensors, path)
    fsync_path(path)


def torch_read(path):
    return torch.load(path)


def safetensors_write(tensors, path):
    safetensors.torch.save_file(tensors, path)
    fsync_path(path)


def safetensors_read(path):
    with open(path, "rb") as file:  # load_file maps the file lazily and would time nothing
        return safetensors.torch.load(file.read())


def naive_write(tensors, path):
    packed = msgpack.packb({
        name: {"dtype": str(t.dtype), "shape": list(t.shape), "data": t.view(torch.uint8).numpy().tobytes()}
        for name, t in tensors.items()
    })
    with open(path, "wb") as file:
        file.write(zstandard.ZstdCompressor().compress(packed))
        file.flush()
        os.fsync(file.fileno())


def naive_read(path):
    with open(path, "rb") as file:
        content = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(file.read()))
    return {
        name: torch.frombuffer(bytearray(entry["data"]), dtype=getattr(torch, entry["dtype"].removeprefix("torch.")))
        .reshape(entry["shape"])
        for name, entry in content.items()
    }


FORMATS = {
    "tracekit": (tracekit_write, tracekit_read),
    "torch.save": (torch_write, torch_read),
    "safetensors": (safetensors_write, safetensors_read),
    "zstd(msgpack)": (naive_write, naive_read),
}


def best_time(action, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def bench_case(tensors, directory: str, repeats: int) -> dict[str, tuple[float, float, int]]:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    results = {}
    for label, (write, read) in FORMATS.items():
        path = os.path.join(directory, "bench-" + label.replace("(", "-").replace(")", ""))
        write_seconds = best_time(lambda: write(tensors, path), repeats)
        read_seconds = best_time(lambda: read(path), repeats)
        if label == "tracekit":
            loaded = read(path)
            assert all(torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)) for name, t in tensors.items())
        results[label] = (nbytes / write_seconds / (1 << 20), nbytes / read_seconds / (1 << 20), os.path.getsize(path))
        os.remove(path)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="tensor bytes per case (default 256)")
    parser.add_argument("--repeats", type=int, default=2, help="best of N timings (default 2)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    args = parser.parse_args()
    print(f"{'case':<16}{'format':<15}{'write MiB/s':>12}{'read MiB/s':>12}{'size MiB':>10}{'size/raw':>10}")
    for dtype in (torch.bfloat16, torch.float32):
        for kind in ("random", "kv-mix"):
            tensors = kv_tensors(kind, dtype, args.mib)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            case = f"{str(dtype).removeprefix('torch.')} {kind}"
            results = bench_case(tensors, args.dir, args.repeats)
            for label, (write_speed, read_speed, size) in results.items():
                print(f"{case:<16}{label:<15}{write_speed:>12.0f}{read_speed:>12.0f}{size / (1 << 20):>10.1f}{size / nbytes:>10.3f}")
            ours, theirs = results["tracekit"], results["torch.save"]
            print(f"{case:<16}{'tracekit/torch':<15}{ours[0] / theirs[0]:>11.2f}x{ours[1] / theirs[1]:>11.2f}x{'':>10}{ours[2] / theirs[2]:>9.3f}x")


if __name__ == "__main__":
    main()
