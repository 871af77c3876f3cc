"""The launch configurations Inductor's Triton kernels were autotuned to: read in the recording
process, kept in the bundle as data, and put back in the replay's process.

Why this exists: Inductor compiles a model's reductions and pointwise ops into Triton kernels,
each generated with a few candidate launch configurations (block sizes, warps, stages). At a
kernel's first launch it times the candidates and keeps the fastest, and timing differs from
process to process. A reduction's block sizes decide the order it sums in, so two processes
running the same compiled step can round differently: on an H200 two recordings of the same
float32 workload already parted at their first compiled step. A bundle therefore carries, for
each autotuned kernel of the recording process, the configuration it launched with, and a replay
makes each kernel of the same source take that configuration instead of timing its candidates.

Inductor has the mechanism: `torch._inductor.config.autotune_lookup_table` maps a kernel's
lookup hash (sha256 of its size hints and its source without its name) to a configuration, which
a kernel takes when it is built, in the compiling process or in a compile worker (torch 2.11 to
2.14). So a choice is keyed by that hash, and applying a bundle's choices is filling that table:
only integers come from a bundle, and nothing it holds is executed. Whether each kernel of the
replay really ran with its recorded configuration is read back after the step and reported
(`compare`), so a kernel that kept another one (loaded from a compile cache, say) is named.
"""

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from tracekit.format.schema import KernelChoice

# Where a kernel's configuration came from (its `autotune_cache_info` state), as recorded.
ORIGINS = {"miss": "timed", "hit": "autotune_cache"}


def _autotuners() -> Iterator[Any]:
    """Every Triton kernel Inductor loaded in this process: the `CachingAutotuner` objects in the
    modules of its code cache (the compiled graphs' output code and the kernels' own modules).
    (vLLM freezes the garbage collector after start-up, so `gc.get_objects()` does not see them.)"""
    try:
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except Exception:  # an Inductor without Triton support: no kernels to read
        return
    modules = list(PyCodeCache.modules) + list(getattr(PyCodeCache, "modules_no_attr", {}).values())
    seen: set[int] = set()
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, CachingAutotuner) and id(value) not in seen:
                seen.add(id(value))
                yield value


def _launched_config(autotuner: Any) -> Any:
    """The configuration a kernel runs with once it was autotuned, found in Inductor's autotune
    cache or given by the lookup table; None while it still has several candidates."""
    launchers = getattr(autotuner, "launchers", None) or []
    if len(launchers) == 1:
        return launchers[0].config
    results = getattr(autotuner, "compile_results", None) or []
    if not launchers and len(results) == 1:
        return results[0].config
    return None


def _triton_source(autotuner: Any) -> str | None:
    """The kernel's `@triton.jit` function source: from its function where the process loaded
    it, else from the source file Inductor wrote (a kernel compiled in a worker process comes
    back without its function)."""
    source = getattr(getattr(autotuner, "fn", None), "src", None)
    if isinstance(source, str):
        return source
    filename = getattr(autotuner, "filename", None)
    try:
        with open(filename, encoding="utf-8") as stream:
            text = stream.read()
    except (OSError, TypeError):
        return None
    parts = text.split("@triton.jit\n", 1)
    return parts[1] if len(parts) == 2 else None


def lookup_hash(autotuner: Any) -> str | None:
    """The key Inductor's lookup table knows the kernel by (None where it takes none: Inductor
    looks up fused kernels only)."""
    from torch._inductor.runtime.triton_heuristics import generate_lookup_hash_from_source_code

    source = _triton_source(autotuner)
    if source is None or "_fused_" not in source:
        return None
    return generate_lookup_hash_from_source_code(str(getattr(autotuner, "size_hints", None)), source)


def config_fields(config: Any) -> dict[str, int]:
    """A Triton config as the lookup table holds one: its block sizes, warps and stages."""
    plain = {name: value for name, value in sorted(getattr(config, "kwargs", {}).items())
             if "BLOCK" in name and isinstance(value, int) and not isinstance(value, bool)}
    plain["num_warps"] = int(config.num_warps)
    plain["num_stages"] = int(config.num_stages)
    return plain


def _had_a_choice(autotuner: Any) -> bool:
    """Whether Inductor chose this kernel's configuration among several: by timing them, from
    its autotune cache, or from the lookup table (a kernel generated with one has no choice)."""
    info = getattr(autotuner, "autotune_cache_info", None) or {}
    return info.get("autotune_cache_state") in ORIGINS or info.get("num_configs", 0) > 1


def _kernel_name(autotuner: Any) -> str:
    name = getattr(getattr(autotuner, "fn", None), "__name__", None)
    if not name:
        name = (getattr(autotuner, "inductor_meta", None) or {}).get("kernel_name")
    return str(name or "?")


def launched_choices(only_chosen: bool = True) -> list[KernelChoice]:
    """The configuration of every launched kernel of this process that Inductor chose among
    several (`only_chosen=False`: every launched kernel with a lookup hash), by lookup hash.

    One source can have several copies (one per compiled graph that loaded it from vLLM's
    compile cache), each configured on its own: the first copy found (in the order the graphs'
    modules were loaded) gives `config`, any other configuration goes to `other_configs`. (Before, the
    last copy met was kept alone: on an H100 a float32 recording loaded from vLLM's compile cache
    recorded XBLOCK=32 for a norm its layer-0 graph ran with XBLOCK=1, as its replays with each
    configuration showed, and its replay parted from layer 1's KV on.)"""
    choices: dict[str, KernelChoice] = {}
    for autotuner in _autotuners():
        config = _launched_config(autotuner)
        if config is None or (only_chosen and not _had_a_choice(autotuner)):
            continue
        digest = lookup_hash(autotuner)
        if digest is None:
            continue
        fields = config_fields(config)
        kept = choices.get(digest)
        if kept is None:
            state = (getattr(autotuner, "autotune_cache_info", None) or {}).get("autotune_cache_state")
            choices[digest] = KernelChoice(_kernel_name(autotuner), digest, fields, ORIGINS.get(state, ""))
        elif fields != kept.config and fields not in kept.other_configs:
            kept.other_configs.append(fields)
    return sorted(choices.values(), key=lambda choice: choice.source_hash)


_HASH = re.compile(r"[0-9a-f]{64}")
# What a Triton launch configuration can be: block sizes and warps are powers of two.
_LIMITS = {"BLOCK": 1 << 16, "num_warps": 32}
_MAX_STAGES = 8


def _valid_config(config: dict[str, Any]) -> bool:
    if not {"num_warps", "num_stages"} <= config.keys():
        return False
    for name, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return False
        if name == "num_stages":
            if value > _MAX_STAGES:
                return False
        elif value & (value - 1) or value > _LIMITS["num_warps" if name == "num_warps" else "BLOCK"]:
            return False
    return True


def lookup_table(choices: list[KernelChoice]) -> dict[str, dict[str, int]]:
    """The bundle's choices as Inductor's lookup table. A bundle is untrusted: an entry that is
    not a sha256 key with power-of-two block sizes and warps and a few stages is left out (its
    kernel autotunes, and `compare` names it)."""
    return {choice.source_hash: dict(choice.config) for choice in choices
            if _HASH.fullmatch(choice.source_hash) and _valid_config(choice.config)}


@contextlib.contextmanager
def choices_applied(choices: list[KernelChoice]) -> Iterator[None]:
    """While active, every fused Triton kernel Inductor builds whose lookup hash has a recorded
    choice takes that configuration instead of being autotuned."""
    table = lookup_table(choices)
    if not table:
        yield
        return
    import torch._inductor.config as inductor_config

    previous = inductor_config.autotune_lookup_table
    inductor_config.autotune_lookup_table = {**previous, **table}
    try:
        yield
    finally:
        inductor_config.autotune_lookup_table = previous


def merged_if_consistent(kept: dict[str, KernelChoice], more: list[KernelChoice]) -> bool:
    """Add `more` to `kept` (by lookup hash) unless one of its kernels has another configuration
    there: bundles whose choices agree can share an engine, whose kernels are built once."""
    if any(choice.source_hash in kept and kept[choice.source_hash].config != choice.config for choice in more):
        return False
    kept.update((choice.source_hash, choice) for choice in more)
    return True


def compare(recorded: list[KernelChoice], here: list[KernelChoice]) -> dict[str, list[str]]:
    """Kernel by kernel, how this process's launched configurations stand against the recorded
    ones: `same`, `other` (the kernel ran with another configuration: `name: here vs recorded`),
    `unrecorded` (autotuned here, no choice in the bundle), `several` (its copies ran with
    several configurations in the recording or here: a replay gives all copies of a source one,
    so those copies cannot all run as recorded)."""
    by_hash = {choice.source_hash: choice for choice in recorded}
    outcome: dict[str, list[str]] = {"same": [], "other": [], "unrecorded": [], "several": []}
    for choice in here:
        wanted = by_hash.get(choice.source_hash)
        if wanted is None:
            outcome["unrecorded"].append(choice.kernel)
        elif wanted.other_configs or choice.other_configs:
            outcome["several"].append(f"{choice.kernel}: {_all(choice)} here, {_all(wanted)} recorded")
        elif wanted.config == choice.config:
            outcome["same"].append(choice.kernel)
        else:
            outcome["other"].append(f"{choice.kernel}: {_short(choice.config)} here, {_short(wanted.config)} recorded")
    return {key: sorted(names) for key, names in outcome.items()}


def _all(choice: KernelChoice) -> str:
    """A kernel's configurations: the one the lookup table gives, then its other copies'."""
    return " and ".join(_short(config) for config in [choice.config, *choice.other_configs])


def _short(config: dict[str, int]) -> str:
    return ",".join(f"{name}={value}" for name, value in config.items())
