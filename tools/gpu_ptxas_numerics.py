"""Whether the ptxas release that builds Inductor's kernels changes what they compute (issue 28).

A float32 step recorded in one process parts from its replay in some runs, from layer 0's
post-attention work on, with every autotuned configuration and every one of vLLM's own Triton
binaries as recorded. One process-dependent input left is which ptxas built Inductor's kernels:
torch's own where Inductor compiles in the process, Triton's (another CUDA release) where a
process loads its code from a cache. This runs Inductor output modules (the probe's copies,
`tools/probe_compiled_code.py`: `code/*.py`) on the same seeded inputs in two fresh processes,
their kernels built by torch's ptxas and by Triton's, each kernel pinned to its first
configuration (no timing), and compares the binaries each process built and every output bit for
bit. Needs a CUDA GPU, torch with Triton, and tracekit's own dependencies (msgpack, zstandard),
not vLLM:

    python tools/gpu_ptxas_numerics.py MODULE.py [MODULE.py ...]
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def ptxas_binaries() -> dict[str, str]:
    """torch's ptxas and Triton's own, by name, where both exist."""
    import torch
    import triton

    found = {"torch": Path(torch.__file__).parent / "bin" / "ptxas",
             "triton": Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"}
    return {name: str(path) for name, path in found.items() if path.is_file()}


def run_modules(modules: list[Path], out: Path) -> None:
    """(In a child whose environment names the ptxas and a fresh Triton cache.) Each module's
    outputs on seeded inputs, written under `out`."""
    import torch

    outputs = {}
    for path in modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for kernel in vars(module).values():
            if getattr(kernel, "launchers", None):
                kernel.launchers = kernel.launchers[:1]  # the first configuration, in both processes
        torch.manual_seed(0)
        results = module.call(list(module.get_args()))
        torch.cuda.synchronize()
        for index, tensor in enumerate(results):
            if isinstance(tensor, torch.Tensor):
                name = f"{path.stem[:8]}.{index}"
                (out / f"{name}.bin").write_bytes(bytes(tensor.detach().contiguous().cpu().untyped_storage()))
                outputs[name] = str(tensor.dtype).removeprefix("torch.")
    (out / "outputs.json").write_text(json.dumps(outputs, sort_keys=True))


def built(triton_cache: Path) -> dict[str, list[str]]:
    """Every binary a process's Triton cache holds, by kernel name: digest and PTX ISA (a statically
    launched Inductor kernel keeps no binary on its launcher; the cache has each one built)."""
    sys.path[:0] = [str(TOOLS), str(TOOLS.parent)]
    from probe_compiled_code import cached_cubin

    found: dict[str, list[str]] = {}
    for cubin in sorted(triton_cache.rglob("*.cubin")):
        binary, isa = cached_cubin(cubin)
        found.setdefault(cubin.stem, []).append(f"{hashlib.sha256(binary).hexdigest()[:12]} (PTX ISA {isa})")
    return {kernel: sorted(binaries) for kernel, binaries in found.items()}


def compare(runs: dict[str, Path]) -> int:
    """Print how the two processes' binaries and outputs differ; 1 where any output differs."""
    import torch

    (a, first), (b, second) = runs.items()
    builds = {name: built(path / "triton") for name, path in runs.items()}
    for kernel in sorted(builds[a]):
        one, other = builds[a][kernel], builds[b].get(kernel)
        same = f"the same {len(one)} binaries" if one == other else f"{a} {one}, {b} {other}"
        print(f"kernel {kernel}: {same}")
    differs = 0
    for name, dtype in sorted(json.loads((first / "outputs.json").read_text()).items()):
        x, y = ((path / f"{name}.bin").read_bytes() for path in (first, second))
        if x == y:
            print(f"output {name}: bit-equal")
            continue
        differs = 1
        left, right = (torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).double() for raw in (x, y))
        delta = (left - right).abs()
        rms = float((delta.square().mean() / left.square().mean().clamp_min(1e-30)).sqrt())
        print(f"output {name}: DIFFERS, max abs {float(delta.max()):.3e}, relative RMS {rms:.3e}, "
              f"{int((delta > 0).sum())} of {delta.numel()} elements")
    return differs


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        run_modules([Path(path) for path in argv[2:]], Path(argv[1]))
        return 0
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    ptxas = ptxas_binaries()
    if len(ptxas) < 2:
        print(f"needs torch's and Triton's ptxas, found {ptxas}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ptxas-numerics-"))
    runs, children = {}, []
    for name, binary in ptxas.items():
        out = runs[name] = work / name
        out.mkdir()
        env = {**os.environ, "TRITON_PTXAS_PATH": binary, "TRITON_CACHE_DIR": str(out / "triton"),
               "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        children.append(subprocess.Popen([sys.executable, __file__, "--child", str(out), *argv], env=env))
    if any(child.wait() != 0 for child in children):
        print("a child failed (above)", file=sys.stderr)
        return 3
    return compare(runs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
