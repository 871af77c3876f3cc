"""Run one `tracekit` command in this process and, when it ends, write what the process ran its
compiled steps with: the Inductor output modules it loaded (their names are hashes of their
source, so two processes ran the same generated code exactly when they list the same names),
each autotuned Triton kernel's launch configuration and the process-wide float32 matmul
settings. (It also listed the binaries of every Triton kernel and this machine's ptxas releases,
until issue 28's runs ruled the ptxas release out: docs/history/issue-28.md.)

Why this exists: a step recorded in one process and replayed in another can round differently
although every input is equal (issue 28: a float32 workload recorded twice on the H100, the
second recording parting from its replay from layer 1 on). Which process-dependent choice moved
has to be measured, not guessed: this tool lists, per process, the choices that can differ, so
two processes' manifests can be compared (`--compare A B`).

    python tools/probe_compiled_code.py OUT_DIR -- record ...     (any tracekit command)
    python tools/probe_compiled_code.py --compare OUT_A OUT_B

cuBLAS's algorithm choices are not listed. cuBLASLt logs the GEMMs it launches where
CUBLASLT_LOG_LEVEL=2 CUBLASLT_LOG_FILE=DIR/%i.log are set before the run (`TRACEKIT_GPU_PROBE=1
tools/gpu_run.sh` sets them): each manifest's `pid` names its process's log.

A `tracekit replay` process's code cache is empty by its exit (also on the CPU), so there the
manifest is written as each step's report is made, while its engine still holds its kernels.
"""

import atexit
import json
import os
import shutil
import sys
from pathlib import Path


def _loaded_modules() -> dict[str, str]:
    """Inductor's code-cache modules loaded in this process: key -> source file (none where the
    process never imported Inductor: importing it at exit would fail)."""
    if "torch._inductor.codecache" not in sys.modules:
        return {}
    from torch._inductor.codecache import PyCodeCache

    modules = list(PyCodeCache.modules) + list(getattr(PyCodeCache, "modules_no_attr", {}).values())
    return {Path(str(getattr(module, "__file__", "?"))).stem: str(getattr(module, "__file__", "")) for module in modules}


def _autotuned_configs() -> dict[str, str]:
    """Each launched kernel's configuration (chosen among several or not), by kernel name and
    lookup hash, with where it came from ("timed" or "autotune_cache") and, where its copies ran
    apart, each copy's by graph key prefix and binding."""
    if "torch._inductor.codecache" not in sys.modules:
        return {}
    from tracekit.graphs.kernel_choices import launched_choices

    return {f"{choice.kernel}@{choice.source_hash}": json.dumps(
                {**choice.config, "origin": choice.origin,
                 **({"other_configs": choice.other_configs} if choice.other_configs else {}),
                 **({"copies": {f"{copy.graph[:12]}/{copy.binding}": copy.config for copy in choice.copies}}
                    if choice.other_configs else {})}, sort_keys=True)
            for choice in launched_choices(only_chosen=False)}


def _matmul_settings() -> dict[str, object]:
    import torch

    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "preferred_blas_library": str(torch.backends.cuda.preferred_blas_library()),
    }


def write_manifest(out: Path) -> None:
    """The manifest and a copy of every loaded module's source, under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    modules = _loaded_modules()
    code = out / "code"
    code.mkdir(exist_ok=True)
    for key, path in modules.items():
        if Path(path).is_file():
            shutil.copy(path, code / f"{key}.py")
    manifest = {
        "modules": sorted(modules),  # each key is the hash of its module's source
        "autotuned": _autotuned_configs(),
        "matmul": _matmul_settings(),
        # joins the process to logs named by process id (CUBLASLT_LOG_FILE=.../%i.log)
        "pid": os.getpid(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def compare(first: Path, second: Path) -> int:
    """What two manifests differ in; exit 1 when they differ."""
    a, b = (json.loads((path / "manifest.json").read_text()) for path in (first, second))
    a["modules"], b["modules"] = dict.fromkeys(a["modules"]), dict.fromkeys(b["modules"])
    differs = 0
    for part in ("modules", "autotuned", "matmul"):
        a.setdefault(part, {})
        b.setdefault(part, {})
        only_a = sorted(set(a[part]) - set(b[part]))
        only_b = sorted(set(b[part]) - set(a[part]))
        changed = sorted(key for key in set(a[part]) & set(b[part]) if a[part][key] != b[part][key])
        print(f"{part}: {len(a[part])} vs {len(b[part])}; only in {first.name}: {len(only_a)}, "
              f"only in {second.name}: {len(only_b)}, changed: {len(changed)}")
        for key in only_a[:20]:
            print(f"  < {key}")
        for key in only_b[:20]:
            print(f"  > {key}")
        for key in changed[:20]:
            print(f"  ~ {key}: {a[part][key]} -> {b[part][key]}")
        differs |= bool(only_a or only_b or changed)
    return int(differs)


def _write_at_each_report(out: Path) -> None:
    """Have the replay write the manifest each time it reports a step (the last one stays)."""
    import tracekit.replay.replayer as replayer

    reported = replayer.report

    def report_and_write(*args, **kwargs):
        result = reported(*args, **kwargs)
        try:
            write_manifest(out)
        except Exception as error:  # a probe never changes what the replay says
            print(f"probe: no manifest: {type(error).__name__}: {error}", file=sys.stderr)
        return result

    replayer.report = report_and_write


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"] and len(argv) == 3:
        return compare(Path(argv[1]), Path(argv[2]))
    if len(argv) < 3 or argv[1] != "--":
        print("usage: probe_compiled_code.py OUT_DIR -- TRACEKIT_ARGS... | --compare OUT_A OUT_B", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if argv[2:3] == ["replay"]:
        _write_at_each_report(out)
    else:
        atexit.register(write_manifest, out)
    from tracekit.cli import main as tracekit_main

    try:
        tracekit_main(args=argv[2:], prog_name="tracekit")
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
