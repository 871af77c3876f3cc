"""Benchmark: a tracekit bundle against torch.save/torch.load, safetensors and naive
zstd(msgpack), writing and reading the same KV-cache-like tensors in one run.

Data sets (each --mib MiB, split into 16 per-layer tensors shaped like vLLM's KV cache
[2, blocks, 16 tokens, 8 heads, 128 dims]):
  random  standard normal values
  kv-mix  60% of blocks hold keys/values with per-channel scales and a few outlier channels
          (as real keys have), 40% are never-used zero blocks
in bfloat16 and float32. Every writer fsyncs its file so that all pay for durability alike.
Reads are timed twice: from the page cache ("warm") and with the file dropped from the page
cache first ("cold", posix_fadvise DONTNEED after an fsync: the bytes come from the disk).
Prints throughput (MiB/s of tensor bytes), file size, and tracekit's ratios to
torch.save/torch.load, and how fast the disk itself reads a cold file (where it reads as fast
as the formats decode, fewer bytes on disk cannot make a cold read faster); each timing is the
best of --repeats. Then it writes a --inspect-gib bundle and times what `tracekit inspect`
does with it (open, index, metadata; best of 5).
Keep it to one run on a shared machine.

    python tools/bench_bundle.py [--mib 256] [--repeats 3] [--dir /tmp] [--cases "bfloat16 kv-mix"] [--inspect-gib 1]
"""

import argparse
import os
import resource
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
        return reader.read_tensors([info.name for info in reader.tensor_infos()], to="torch")


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


def best_time(action, repeats: int, before=None) -> float:
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        cpu_start = cpu_seconds()
        action()
        best = min(best, time.perf_counter() - start)
        CPU_SECONDS[-1] = min(CPU_SECONDS[-1], cpu_seconds() - cpu_start)
    return best


def cpu_seconds() -> float:
    """This process's CPU time, all threads: unlike the clock, barely moved by busy neighbours."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


CPU_SECONDS = [float("inf")]  # the last best_time's least CPU time


def drop_from_page_cache(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def raw_read(path: str) -> None:
    with open(path, "rb", buffering=0) as file:
        buffer = bytearray(8 << 20)
        while file.readinto(buffer):
            pass


def bench_case(tensors, directory: str, repeats: int) -> dict[str, tuple]:
    """The formats take turns within each repetition so that a noisy neighbour hits all of them
    alike; CPU time (all threads) is reported too, as MiB per CPU-second."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    paths = {label: os.path.join(directory, "bench-" + label.replace("(", "-").replace(")", "")) for label in FORMATS}
    best = {label: [float("inf")] * 5 for label in FORMATS}
    for _ in range(repeats):
        for label, (write, read) in FORMATS.items():
            path = paths[label]
            CPU_SECONDS[-1] = float("inf")
            write_seconds = best_time(lambda write=write, path=path: write(tensors, path), 1)
            write_cpu = CPU_SECONDS[-1]
            CPU_SECONDS[-1] = float("inf")
            warm_seconds = best_time(lambda read=read, path=path: read(path), 1)
            read_cpu = CPU_SECONDS[-1]
            cold_seconds = best_time(lambda read=read, path=path: read(path), 1,
                                     before=lambda path=path: drop_from_page_cache(path))
            timings = (write_seconds, warm_seconds, cold_seconds, write_cpu, read_cpu)
            best[label] = [min(old, new) for old, new in zip(best[label], timings)]
    disk = best_time(lambda: raw_read(paths["torch.save"]), repeats, before=lambda: drop_from_page_cache(paths["torch.save"]))
    print(f"(this disk: a cold file reads at {os.path.getsize(paths['torch.save']) / disk / (1 << 20):.0f} MiB/s, "
          "read(2) in 8 MiB blocks, nothing decoded)")
    loaded = tracekit_read(paths["tracekit"])
    assert all(torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)) for name, t in tensors.items())
    results = {}
    for label, path in paths.items():
        results[label] = (*(nbytes / seconds / (1 << 20) for seconds in best[label]), os.path.getsize(path))
        os.remove(path)
    return results  # {format: (write, warm read, cold read MiB/s, write, read MiB per CPU-second, bytes)}


def bench_inspect(directory: str, gib: float) -> None:
    """What `tracekit inspect` reads (header, trailer, index, metadata) of a big bundle."""
    from tracekit.share.summary import summary_of

    tensors = kv_tensors("kv-mix", torch.bfloat16, int(gib * 1024))
    path = os.path.join(directory, "bench-inspect.zst")
    tracekit_write(tensors, path)
    del tensors

    def inspect():
        with open_bundle(path) as reader:
            summary_of(reader)

    seconds = best_time(inspect, 5)
    print(f"inspect of a {os.path.getsize(path) / (1 << 30):.2f} GiB bundle ({gib:g} GiB of tensors): {seconds * 1000:.1f} ms")
    os.remove(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="tensor bytes per case (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N timings (default 3)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    parser.add_argument("--cases", nargs="*", help='only these cases, e.g. "bfloat16 kv-mix"')
    parser.add_argument("--inspect-gib", type=float, default=1.0, help="size of the inspect case (0: skip)")
    args = parser.parse_args()
    print(f"{'case':<16}{'format':<15}{'write MiB/s':>12}{'warm read':>10}{'cold read':>10}{'size MiB':>10}{'size/raw':>10}"
          f"{'write/cpu-s':>12}{'read/cpu-s':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        for kind in ("random", "kv-mix"):
            case = f"{str(dtype).removeprefix('torch.')} {kind}"
            if args.cases and case not in args.cases:
                continue
            tensors = kv_tensors(kind, dtype, args.mib)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            results = bench_case(tensors, args.dir, args.repeats)
            for label, (write_speed, warm, cold, write_cpu, read_cpu, size) in results.items():
                print(f"{case:<16}{label:<15}{write_speed:>12.0f}{warm:>10.0f}{cold:>10.0f}{size / (1 << 20):>10.1f}"
                      f"{size / nbytes:>10.3f}{write_cpu:>12.0f}{read_cpu:>11.0f}")
            ours, theirs = results["tracekit"], results["torch.save"]
            ratio = [f"{mine / other:.2f}x" for mine, other in zip(ours, theirs)]
            print(f"{case:<16}{'tracekit/torch':<15}{ratio[0]:>12}{ratio[1]:>10}{ratio[2]:>10}{'':>10}{ratio[5]:>10}"
                  f"{ratio[3]:>12}{ratio[4]:>11}")
    if args.inspect_gib:
        bench_inspect(args.dir, args.inspect_gib)


if __name__ == "__main__":
    main()
