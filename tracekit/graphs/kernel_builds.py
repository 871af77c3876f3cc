"""Which ptxas built the Triton kernels a step ran that Inductor did not generate (an engine's
own attention, sampling and cache kernels): read in the recording process, kept in the bundle as
data, and used again where the replay's process builds the same kernels.

Why this exists: Triton builds a `@triton.jit` kernel at its first launch in a process (or loads
it from its disk cache) with the ptxas that `TRITON_PTXAS_PATH` names at that moment, else its
own. Inductor sets that variable to torch's ptxas the first time it builds a kernel in the
process itself rather than in a compile worker, which depends on whether its worker pool was
ready in time; and Triton keys its disk cache with the release of the first ptxas it met in the
process, so a binary one ptxas built can be loaded where another was asked for. So one vLLM
kernel is built by one ptxas release in one process and by another in the next (measured on the
H100, issue 28: a float32 engine's vLLM kernels, its Triton attention among them, built for PTX
ISA 9.0 in a first process and 8.7 in a second that found the first's compile caches), and two
binaries of one kernel need not round alike.

A build is kept as the kernel's module-qualified name, its specialization (Triton's hash of the
kernel's source, argument types and constants: `ASTSource.hash`), the PTX ISA it was
built for (Triton derives it from the ptxas release: 8.8 for CUDA 12.9, 9.0 for 13.0) and the
sha256 of its binary. A replay builds each recorded kernel with a ptxas of this machine whose
release gives the recorded ISA, into a Triton cache of that ptxas's own (no binary another ptxas
built under the same key can be loaded there), and reports kernel by kernel whether it ran the
very binary recorded. Only strings come from a bundle: the ptxas run is always one of this
machine's own, chosen by the release it reports.
"""

import contextlib
import functools
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracekit.format.schema import KernelBuild

# Modules whose kernels are Inductor's (their launch configurations are `kernel_choices`' part).
INDUCTOR_MODULES = ("torch._inductor",)
# The variables Triton reads for its ptxas (which one depends on the release and the target) and
# for its disk cache.
PTXAS_VARIABLES = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
CACHE_VARIABLE = "TRITON_CACHE_DIR"

_ISA = re.compile(r"\d{1,2}\.\d")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_NAME = 300

# Readers' caches: the kernels of modules already scanned, the digest of each binary read.
_scanned: dict[str, Any] = {"modules": -1, "functions": []}
_binary_digests: dict[int, tuple[Any, str]] = {}


def _jit_functions() -> list[Any]:
    """The `@triton.jit` functions defined at module level outside Inductor (an autotuned or
    heuristics-wrapped one through its `fn`), found again only when modules were imported."""
    if len(sys.modules) == _scanned["modules"]:
        return _scanned["functions"]
    try:
        from triton.runtime.jit import JITFunction, KernelInterface
    except Exception:  # no Triton: no kernels of its
        return []
    functions: dict[int, Any] = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(INDUCTOR_MODULES):
            continue
        try:
            values = list(getattr(module, "__dict__", {}).values())
        except Exception:
            continue
        for value in values:
            # (type(), not isinstance: a deprecated module attribute warns when asked its __class__)
            while issubclass(type(value), KernelInterface) and not issubclass(type(value), JITFunction):
                value = getattr(value, "fn", None)
            if issubclass(type(value), JITFunction):
                functions[id(value)] = value
    _scanned.update(modules=len(sys.modules), functions=list(functions.values()))
    return _scanned["functions"]


def full_name(function: Any) -> str:
    """A JIT function's module-qualified name, as reports name its kernel."""
    inner = getattr(function, "fn", function)
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', '?')}"


def ptx_isa_of(asm: Any) -> str | None:
    """The PTX ISA a compiled Triton kernel was built for, from the PTX its `asm` keeps (None
    where it keeps none)."""
    ptx = asm.get("ptx") if hasattr(asm, "get") else None
    found = re.search(r"^\.version (\d+\.\d+)", ptx or "", re.M)
    return found.group(1) if found else None


def _binary_digest(kernel: Any) -> str | None:
    kept = _binary_digests.get(id(kernel))
    if kept is not None and kept[0] is kernel:
        return kept[1]
    binary = getattr(kernel, "kernel", None)
    if not isinstance(binary, bytes):
        return None
    digest = hashlib.sha256(binary).hexdigest()
    _binary_digests[id(kernel)] = (kernel, digest)
    return digest


def _build_of(function: Any, kernel: Any) -> KernelBuild | None:
    """The build of one compiled kernel, or None where it is not a finished binary built from a
    source (a compile still under way, an IR file)."""
    source = getattr(kernel, "src", None)
    metadata = getattr(kernel, "metadata", None)
    if source is None or metadata is None or not hasattr(source, "hash") or not hasattr(kernel, "asm"):
        return None
    isa, digest = ptx_isa_of(kernel.asm), _binary_digest(kernel)
    if isa is None or digest is None:
        return None
    return KernelBuild(full_name(function), source.hash(), isa, digest)


def launched_builds() -> list[KernelBuild]:
    """Every Triton kernel this process built or loaded outside Inductor so far, one per
    specialization. Reading never builds or launches anything."""
    builds: dict[tuple[str, str], KernelBuild] = {}
    for function in _jit_functions():
        for caches in list(getattr(function, "device_caches", {}).values()):
            for kernel in list(caches[0].values()):
                try:
                    build = _build_of(function, kernel)
                except Exception:  # a kernel object of another shape: left out
                    build = None
                if build is not None:
                    builds[build.specialization, build.binary] = build
    return sorted(builds.values(), key=lambda build: (build.kernel, build.specialization, build.binary))


def valid_builds(builds: list[KernelBuild]) -> list[KernelBuild]:
    """The builds of a bundle (untrusted) that are what a build can be: a short name, sha256
    digests, an ISA such as 8.8; the rest are left out (their kernels build as Triton would)."""
    return [build for build in builds
            if isinstance(build.kernel, str) and 0 < len(build.kernel) <= _MAX_NAME
            and all(isinstance(value, str) for value in (build.specialization, build.ptx_isa, build.binary))
            and _SHA256.fullmatch(build.specialization) and _SHA256.fullmatch(build.binary)
            and _ISA.fullmatch(build.ptx_isa)]


@functools.lru_cache(maxsize=16)
def ptxas_release(path: str) -> str | None:
    """The CUDA release a ptxas binary reports (`12.9`), or None where it does not run."""
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", text)
    return found.group(1) if found else None


def isa_of_release(release: str) -> str:
    """The PTX ISA Triton builds for with a ptxas of `release` (its `ptx_get_version` rule)."""
    major, minor = map(int, release.split("."))
    if major >= 13:
        number = 90 + (major - 13) * 10 + minor
    elif major == 12:
        number = 80 + minor - (1 if minor >= 6 else 0)
    elif major == 11:
        number = 70 + minor
    else:
        number = 63 + minor
    return f"{number // 10}.{number % 10}"


def ptxas_candidates() -> list[str]:
    """The ptxas binaries of this machine Triton could be given: the ones the variables name
    now, torch's own (which Inductor gives it) and Triton's own."""
    candidates = [os.environ[name] for name in PTXAS_VARIABLES if os.environ.get(name)]
    with contextlib.suppress(Exception):
        import torch

        candidates.append(str(Path(torch.__file__).parent / "bin" / "ptxas"))
    with contextlib.suppress(Exception):
        import triton

        bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        candidates.extend(str(bin_dir / name) for name in ("ptxas", "ptxas-blackwell"))
    return [path for path in dict.fromkeys(candidates) if Path(path).is_file() and os.access(path, os.X_OK)]


def ptxas_by_isa() -> dict[str, str]:
    """ISA -> the first candidate ptxas whose release builds for it."""
    chosen: dict[str, str] = {}
    for path in ptxas_candidates():
        release = ptxas_release(path)
        if release is not None:
            chosen.setdefault(isa_of_release(release), path)
    return chosen


def _cache_dir(ptxas: str) -> str:
    """A Triton cache of `ptxas`'s own: every binary in it was built by that ptxas."""
    digest = hashlib.sha256(f"{ptxas}-{ptxas_release(ptxas)}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"tracekit-triton-{os.getuid()}", digest)


@contextlib.contextmanager
def _variables(values: dict[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class BuildsApplied:
    """What `builds_applied` could do: the recorded kernels it builds with their recorded ptxas
    release, and those it cannot (`missing`: kernel -> the ISA no ptxas here builds for)."""

    def __init__(self, builds: list[KernelBuild], ptxas: dict[str, str]):
        self.ptxas_of: dict[str, str] = {}  # specialization -> the ptxas to build it with
        self.missing: dict[str, str] = {}
        isas: dict[str, set[str]] = {}
        for build in valid_builds(builds):
            isas.setdefault(build.specialization, set()).add(build.ptx_isa)
            if build.ptx_isa not in ptxas:
                self.missing[build.kernel] = build.ptx_isa
        for identity, wanted in isas.items():
            if len(wanted) == 1 and next(iter(wanted)) in ptxas:  # (two releases for one source: left to Triton)
                self.ptxas_of[identity] = ptxas[next(iter(wanted))]

    def wrap(self, compile_kernel: Any) -> Any:
        """Triton's `compile`, building a recorded kernel with its recorded ptxas release into
        that ptxas's own cache, every other kernel as Triton would."""
        def compile_as_recorded(source: Any, *args: Any, **kwargs: Any) -> Any:
            path = self._ptxas_for(source)
            if path is None:
                return compile_kernel(source, *args, **kwargs)
            settings = dict.fromkeys(PTXAS_VARIABLES, path)
            settings[CACHE_VARIABLE] = _cache_dir(path)
            with _variables(settings):
                return compile_kernel(source, *args, **kwargs)

        compile_as_recorded.__wrapped__ = compile_kernel  # type: ignore[attr-defined]
        return compile_as_recorded

    def _ptxas_for(self, source: Any) -> str | None:
        if not self.ptxas_of or not hasattr(source, "hash") or not hasattr(source, "fn"):
            return None
        try:
            return self.ptxas_of.get(source.hash())
        except Exception:  # a source Triton itself could not hash: left to Triton
            return None


@contextlib.contextmanager
def builds_applied(builds: list[KernelBuild]) -> Iterator[BuildsApplied]:
    """While active, Triton builds each recorded kernel with a ptxas of the recorded release
    (`triton.compiler.compile` is wrapped: Triton's JIT looks it up when a kernel first launches)."""
    applied = BuildsApplied(builds, ptxas_by_isa() if valid_builds(builds) else {})
    if not applied.ptxas_of:
        yield applied
        return
    import triton.compiler

    original = triton.compiler.compile
    triton.compiler.compile = applied.wrap(original)
    try:
        yield applied
    finally:
        triton.compiler.compile = original


def consistent(kept: dict[str, KernelBuild], more: list[KernelBuild]) -> bool:
    """Whether `more` asks no kernel of `kept` (by specialization) for another PTX ISA: bundles
    whose builds agree can share an engine, whose kernels are built once."""
    return all(kept[build.specialization].ptx_isa == build.ptx_isa
               for build in more if build.specialization in kept)


def compare(recorded: list[KernelBuild], here: list[KernelBuild]) -> dict[str, list[str]]:
    """Kernel by kernel, how this process's builds stand against the recorded ones: `same` (the
    very binary), `other` (another binary: `name: ISA here vs recorded`), `unrecorded` (built
    here, not in the bundle). A kernel the replay never built is not listed."""
    by_identity: dict[str, list[KernelBuild]] = {}
    for build in valid_builds(recorded):
        by_identity.setdefault(build.specialization, []).append(build)
    outcome: dict[str, list[str]] = {"same": [], "other": [], "unrecorded": []}
    for build in here:
        wanted = by_identity.get(build.specialization)
        if wanted is None:
            outcome["unrecorded"].append(build.kernel)
        elif any(recorded_build.binary == build.binary for recorded_build in wanted):
            outcome["same"].append(build.kernel)
        else:
            isas = sorted({recorded_build.ptx_isa for recorded_build in wanted})
            recorded_as = (f"another one for {build.ptx_isa} recorded (the same ptxas release built it otherwise)"
                           if isas == [build.ptx_isa] else f"{'/'.join(isas)} recorded")
            outcome["other"].append(f"{build.kernel}: a PTX ISA {build.ptx_isa} binary here, {recorded_as}")
    return {key: sorted(names) for key, names in outcome.items()}
