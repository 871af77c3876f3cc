"""The launch configurations Inductor's Triton kernels were autotuned to: read in the recording
process, kept in the bundle as data, and put back in the replay's process, copy by copy
(docs/GUIDE.md, "Kernel choices", says why, and what a replay reports).

A choice is keyed by Inductor's lookup hash (sha256 of the kernel's size hints and its source
without its name); applying choices fills `torch._inductor.config.autotune_lookup_table`, which a
kernel reads when it is built, in the compiling process or a compile worker (torch 2.11 to 2.14):
only integers come from a bundle, and nothing it holds is executed. That table is keyed by source,
while each compiled graph's module may bind a copy of its own (`graph_digest`); where a kernel's
copies ran apart the replay binds, in each graph module as it is loaded (`PyCodeCache.load_by_key_path`,
the one loader of Inductor's generated graph code) and before its first launch, a copy built for
that configuration alone. How each kernel and copy ran is read back after the step (`compare`).
"""

import contextlib
import copy as copying
import dataclasses
import hashlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.format.schema import KernelChoice, KernelCopy

# Where a kernel's configuration came from (its `autotune_cache_info` state), as recorded.
ORIGINS = {"miss": "timed", "hit": "autotune_cache"}


def _bindings() -> Iterator[tuple[Any, str, Any]]:
    """Every Triton kernel Inductor loaded in this process, where it is bound: (module, global
    name, `CachingAutotuner`) over the modules of its code cache in load order (the compiled
    graphs' output code, then the kernels' own modules). (vLLM freezes the garbage collector
    after start-up, so `gc.get_objects()` does not see them.)"""
    try:
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except Exception:  # an Inductor without Triton support: no kernels to read
        return
    modules = list(PyCodeCache.modules) + list(getattr(PyCodeCache, "modules_no_attr", {}).values())
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, CachingAutotuner):
                yield module, name, value


def _launched_config(autotuner: Any) -> Any:
    """The configuration a kernel runs with once it was autotuned, found in Inductor's autotune
    cache or given by the lookup table; None while it still has several candidates. (Under
    Triton's interpreter a kernel always runs its first configuration.)"""
    if getattr(autotuner, "triton_interpret", False):
        configs = getattr(autotuner, "configs", None) or []
        return configs[0] if configs else None
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


# -- copies: which compiled graph binds a kernel ---------------------------------------------------


def graph_digest(code: str) -> str:
    """The key of a compiled graph's module: the sha256 of its code less its blank and comment
    lines. Its comments are what differs between two processes compiling the same graph (the
    `# kernel path:` of each kernel names the process's cache folder, `# AOT ID:` counts the graphs
    it compiled before); its code (kernel sources, launches, buffers) is what tells graphs apart."""
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


# Graph modules' keys by file (Inductor names a module's file by a hash of its code).
_graph_digests: dict[str, str | None] = {}


def _graph_of(module: Any, path: str | None = None) -> str | None:
    """The key of `module` if it is a compiled graph's module (its entry point is `call`), read
    from its file; None for a kernel's own module, or a file gone."""
    if not callable(getattr(module, "call", None)):
        return None
    path = str(path or getattr(module, "__file__", "") or "")
    if path not in _graph_digests:
        try:
            _graph_digests[path] = graph_digest(Path(path).read_text(encoding="utf-8")) if path else None
        except (OSError, UnicodeDecodeError):
            _graph_digests[path] = None
    return _graph_digests[path]


def launched_choices(only_chosen: bool = True) -> list[KernelChoice]:
    """The configuration of every launched kernel of this process that Inductor chose among
    several (`only_chosen=False`: every launched kernel with a lookup hash), by lookup hash, with
    each copy a compiled graph binds.

    The first copy found (in the order the graphs' modules were loaded) gives `config`, any other
    configuration goes to `other_configs`, and each graph module's copy is kept with its own
    (on an H100 a float32 recording whose kernels came back from the compile workers ran a norm
    with XBLOCK=1 in its layer-0 graph and XBLOCK=32 in its layer-1 graph; a bundle that kept one
    parted from its replay from layer 1's KV on)."""
    choices: dict[str, KernelChoice] = {}
    for module, name, autotuner in _bindings():
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
            kept = choices[digest] = KernelChoice(_kernel_name(autotuner), digest, fields, ORIGINS.get(state, ""))
        elif fields != kept.config and fields not in kept.other_configs:
            kept.other_configs.append(fields)
        graph = _graph_of(module)
        if graph is not None and (copy := KernelCopy(graph, name, fields)) not in kept.copies:
            kept.copies.append(copy)
    for choice in choices.values():
        choice.copies.sort(key=lambda copy: (copy.graph, copy.binding, _frozen(copy.config)))
    return sorted(choices.values(), key=lambda choice: choice.source_hash)


def _frozen(config: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(config.items()))


def _copy_configs(choice: KernelChoice) -> dict[tuple[str, str], list[dict[str, int]]]:
    """Each copy's configurations by (graph, binding): one, unless identical graph modules bound
    copies configured apart (then they cannot be told apart)."""
    table: dict[tuple[str, str], list[dict[str, int]]] = {}
    for copy in choice.copies:
        configs = table.setdefault((copy.graph, copy.binding), [])
        if copy.config not in configs:
            configs.append(copy.config)
    return table


def ran_apart(choice: KernelChoice) -> bool:
    """Whether the copies of a kernel source ran with several configurations (what Inductor's
    lookup table, keyed by source, cannot give)."""
    return len({_frozen(copy.config) for copy in choice.copies}) > 1


# -- what a replay takes from a bundle -------------------------------------------------------------

_HASH = re.compile(r"[0-9a-f]{64}")
_BINDING = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,299}")
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


def copy_table(choices: list[KernelChoice]) -> tuple[dict[tuple[str, str], dict[str, int]], list[str]]:
    """The configuration each copy of a kernel whose copies ran apart is to be given, by (graph,
    binding), and the copies refused: not a sha256 graph key, a global's name and a launch
    configuration (a bundle is untrusted). A key with several configurations (identical graph
    modules) is in neither: `compare` names its kernel with every configuration."""
    table: dict[tuple[str, str], dict[str, int]] = {}
    refused = []
    for choice in choices:
        if not ran_apart(choice) or not _HASH.fullmatch(choice.source_hash):
            continue
        for (graph, binding), configs in _copy_configs(choice).items():
            config = configs[0]
            if not (_HASH.fullmatch(graph) and _BINDING.fullmatch(binding) and _valid_config(config)):
                refused.append(f"{choice.kernel} in graph {graph[:12]!r}: {_short(config)} is no copy a replay "
                               "can give (a graph key is a sha256, a binding a name, a configuration a launch one)")
            elif len(configs) == 1:
                table[(graph, binding)] = config
    return table, sorted(refused)


@dataclass
class ChoicesApplied:
    """What a replay did with the bundle's copies while its engine was built and run: the copies
    it gave their own configuration (`pinned`) and those it could not (`unapplied`, with why)."""

    copies: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    pinned: list[str] = field(default_factory=list)
    unapplied: list[str] = field(default_factory=list)
    _made: dict[int, Any] = field(default_factory=dict, repr=False)

    def pin_graph(self, module: Any, path: str) -> None:
        """Give each recorded copy that the compiled graph `module` (just loaded from `path`, not
        yet run) binds a kernel of its own built for its configuration. Never raises: a copy that
        cannot be given its configuration is named in `unapplied` and runs as Inductor made it."""
        try:
            graph = _graph_of(module, path)
            if graph is None:
                return
            for name, value in list(vars(module).items()):
                config = self.copies.get((graph, name))
                if config is None or id(value) in self._made:
                    continue
                where = f"{name} in graph {graph[:12]}"
                try:
                    pinned = pinned_copy(value, config)
                except Exception as error:  # torch's internals moved: say so, run as Inductor made it
                    self.unapplied.append(f"{where}: {_short(config)} not given ({type(error).__name__}: "
                                          f"{str(error).splitlines()[0] if str(error) else ''})")
                    continue
                setattr(module, name, pinned)
                self._made[id(pinned)] = pinned
                self.pinned.append(f"{where}: {_short(config)}")
        except Exception as error:
            self.unapplied.append(f"graph module {path}: not read ({type(error).__name__}: {error})")


# What a copy given its recorded configuration must not do at its first launch: tune on from it.
_FURTHER_TUNING = ("coordinate_descent_tuning", "combo_tuning_groups")


def pinned_copy(autotuner: Any, fields: dict[str, int]) -> Any:
    """A copy of the `CachingAutotuner` `autotuner` that launches with the configuration `fields`
    alone, built as Inductor builds a configuration it was not generated with (its autotune
    cache's best config, a coordinate-descent result): the kernel's function (reloaded from its
    source where a compile worker built it: `_reload_kernel`, which Inductor keeps for that),
    `_precompile_config` (in this process, with the ptxas Inductor's own builds use), then
    `_make_launchers`. Its one launcher makes `run` skip autotuning
    (torch 2.11 to 2.14); its binaries are its own, so the original's autotuning, if it ever runs,
    cannot free them. Under Triton's interpreter `run` launches `configs[0]`, so that is set."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    if not isinstance(autotuner, CachingAutotuner):
        raise TypeError(f"bound to a {type(autotuner).__name__}, not a CachingAutotuner")
    config = _config_for(autotuner, fields)
    pinned = object.__new__(type(autotuner))
    pinned.__dict__.update(autotuner.__dict__)
    pinned.lock = threading.Lock()
    pinned.inductor_meta = {name: value for name, value in autotuner.inductor_meta.items() if name not in _FURTHER_TUNING}
    for cached in ("_cached_launcher", "_debug_call"):  # (torch 2.13 on) a launch's caches
        if cached in pinned.__dict__:
            setattr(pinned, cached, None)
    if getattr(autotuner, "triton_interpret", False):
        pinned.configs = [config]
        return pinned
    if getattr(pinned.fn, "fn", None) is None:  # built in a compile worker, which drops the function
        pinned.fn = pinned._reload_kernel().fn
    _as_inductor_builds_in_its_process()
    pinned.benchmark_failure_reasons = {}
    pinned.compile_results = [pinned._precompile_config(config)]
    pinned.launchers = []
    pinned._make_launchers()
    return pinned


def _as_inductor_builds_in_its_process() -> None:
    """What Inductor does before it builds a kernel in its own process rather than in a compile
    worker (`AsyncCompile.triton`; a worker does the same first): point Triton at torch's ptxas
    and libdevice where the process has not chosen its own (torch 2.11 to 2.14; 2.11 has no
    libdevice step)."""
    from torch._inductor.runtime import compile_tasks

    for step in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        getattr(compile_tasks, step, lambda: None)()


def _config_for(autotuner: Any, fields: dict[str, int]) -> Any:
    """The kernel's own candidate configuration with these fields where it has one (a copy), else
    one made as Inductor's lookup table makes it (`lookup_autotune_config`)."""
    from torch._inductor.runtime.triton_heuristics import Config

    candidates = [*(getattr(autotuner, "configs", None) or []),
                  *(result.config for result in getattr(autotuner, "compile_results", None) or []),
                  *(launcher.config for launcher in getattr(autotuner, "launchers", None) or [])]
    for candidate in candidates:
        if config_fields(candidate) == fields:
            return copying.deepcopy(candidate)
    blocks = {name: value for name, value in fields.items() if "BLOCK" in name}
    return Config(blocks, num_warps=fields["num_warps"], num_stages=fields["num_stages"])


@contextlib.contextmanager
def _graph_loads_pinned(applied: ChoicesApplied) -> Iterator[None]:
    """While active, every module Inductor loads from its code cache goes through
    `applied.pin_graph` before it is returned to its caller."""
    from torch._inductor.codecache import PyCodeCache

    original = PyCodeCache.__dict__["load_by_key_path"]

    def load_by_key_path(cls: Any, key: str, path: str, *args: Any, **kwargs: Any) -> Any:
        module = original.__func__(cls, key, path, *args, **kwargs)
        applied.pin_graph(module, path)
        return module

    PyCodeCache.load_by_key_path = classmethod(load_by_key_path)
    try:
        yield
    finally:
        PyCodeCache.load_by_key_path = original


@contextlib.contextmanager
def choices_applied(choices: list[KernelChoice]) -> Iterator[ChoicesApplied]:
    """While active, every fused Triton kernel Inductor builds whose lookup hash has a recorded
    choice takes that configuration instead of being autotuned, and each copy of a kernel whose
    copies ran apart takes its own in the compiled graphs loaded meanwhile."""
    table = lookup_table(choices)
    copies, refused = copy_table(choices)
    applied = ChoicesApplied(copies, unapplied=refused)
    if not table and not copies:
        yield applied
        return
    import torch._inductor.config as inductor_config

    previous = inductor_config.autotune_lookup_table
    inductor_config.autotune_lookup_table = {**previous, **table}
    try:
        with _graph_loads_pinned(applied) if copies else contextlib.nullcontext():
            yield applied
    finally:
        inductor_config.autotune_lookup_table = previous


def merged_if_consistent(kept: dict[str, KernelChoice], more: list[KernelChoice]) -> bool:
    """Add `more` to `kept` (by lookup hash) unless one of its kernels would run otherwise under
    the other's choices: another configuration, a copy (same graph and global) configured
    otherwise, or copies given their own configurations where the other bundle says nothing of
    its copies. Bundles whose choices agree can share an engine, whose kernels are built once."""
    if any(choice.source_hash in kept and not _agree(kept[choice.source_hash], choice) for choice in more):
        return False
    for choice in more:
        old = kept.get(choice.source_hash)
        kept[choice.source_hash] = choice if old is None else _merged(old, choice)
    return True


def _agree(one: KernelChoice, other: KernelChoice) -> bool:
    if one.config != other.config:
        return False
    ones, others = _copy_configs(one), _copy_configs(other)
    if any(sorted(map(_frozen, ones[key])) != sorted(map(_frozen, others[key])) for key in ones.keys() & others.keys()):
        return False
    return not ((ran_apart(one) and not others) or (ran_apart(other) and not ones))


def _merged(one: KernelChoice, other: KernelChoice) -> KernelChoice:
    configs = [*one.other_configs, *(config for config in other.other_configs
                                     if config != one.config and config not in one.other_configs)]
    copies = [*one.copies, *(copy for copy in other.copies if copy not in one.copies)]
    return dataclasses.replace(one, other_configs=configs, copies=copies)


def compare(recorded: list[KernelChoice], here: list[KernelChoice],
            applied: ChoicesApplied | None = None) -> dict[str, list[str]]:
    """Kernel by kernel, how this process's launched configurations stand against the recorded
    ones: `same`, `other` (a kernel, or one copy of it, ran with another configuration:
    `name: here vs recorded`), `unrecorded` (autotuned here, no choice in the bundle), `several`
    (its copies ran with several configurations and could not all be told apart, in the
    recording or here: some may have run otherwise than recorded), and from `applied`, the copies
    whose recorded configuration this replay could not give them (`unapplied`, with why)."""
    by_hash = {choice.source_hash: choice for choice in recorded}
    outcome: dict[str, list[str]] = {"same": [], "other": [], "unrecorded": [], "several": []}
    for choice in here:
        wanted = by_hash.get(choice.source_hash)
        if wanted is None:
            outcome["unrecorded"].append(choice.kernel)
        elif wanted.copies and choice.copies:
            _compare_copies(wanted, choice, outcome)
        elif wanted.other_configs or choice.other_configs:
            outcome["several"].append(_several(wanted, choice))
        elif wanted.config == choice.config:
            outcome["same"].append(choice.kernel)
        else:
            outcome["other"].append(f"{choice.kernel}: {_short(choice.config)} here, {_short(wanted.config)} recorded")
    outcome["unapplied"] = list(applied.unapplied) if applied is not None else []
    return {key: sorted(names) for key, names in outcome.items()}


def _compare_copies(wanted: KernelChoice, choice: KernelChoice, outcome: dict[str, list[str]]) -> None:
    """One kernel, copy by copy: each copy here against the recorded copy of the same graph and
    global, or against the kernel's one configuration where the recording kept no such copy."""
    recorded = _copy_configs(wanted)
    apart = ran_apart(wanted) or bool(wanted.other_configs)
    other, undecided = [], False
    for copy in choice.copies:
        configs = recorded.get((copy.graph, copy.binding))
        if configs is None and not apart:
            configs = [wanted.config]
        if configs is None or len(configs) > 1:
            undecided = True
        elif copy.config != configs[0]:
            other.append(f"{choice.kernel} in graph {copy.graph[:12]}: {_short(copy.config)} here, "
                         f"{_short(configs[0])} recorded")
    if undecided:
        outcome["several"].append(_several(wanted, choice))
    elif other:
        outcome["other"].extend(other)
    else:
        outcome["same"].append(choice.kernel)


def _several(wanted: KernelChoice, choice: KernelChoice) -> str:
    """A kernel's configurations here and recorded: the one the lookup table gives, then its other copies'."""
    here, recorded = (" and ".join(map(_short, [each.config, *each.other_configs])) for each in (choice, wanted))
    return f"{choice.kernel}: {here} here, {recorded} recorded"


def _short(config: dict[str, int]) -> str:
    return ",".join(f"{name}={value}" for name, value in config.items())
