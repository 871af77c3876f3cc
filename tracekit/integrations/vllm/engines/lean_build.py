"""Building a replay engine that holds only what its recorded steps need: a "lean" engine
(docs/GUIDE.md, "A lean engine", says what it leaves out and why). The same engine arguments give
it the same capture tables, padding and dispatch; only less is built:

* Graphs: just before the runner's `capture_model`, its table of graphs (V1's dispatcher keys,
  V2's graph manager descriptors) is cut to the wanted (mode, size) pairs: a wanted step's key is
  kept, and the keys checked before it failed to match in the full engine too.
* Compile sizes: single-size compiles no wanted step runs at are dropped; compile ranges stay
  whole (the profiling run at the largest batch needs the last range anyway).
* The release's `lean_env`, `COMPILE_HERE_ENV` for steps that carry kernel choices (any engine),
  and `gc.freeze` of every object that exists before the build (which allocates millions of
  objects: each collection would walk the imported modules again).

What a build kept is remembered per engine (`build_of`), for the replay's report.
"""

import gc
import os
import time
import weakref
from collections.abc import Collection, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from tracekit.format.schema import GraphDispatch, Step
from tracekit.graphs.modes import ReplayMode, expand_modes
from tracekit.integrations.vllm.engines.build import build_llm, forget_cached_vllm_envs
from tracekit.integrations.vllm.releases.base import classes_here
from tracekit.integrations.vllm.releases.installed import installed_release
from tracekit.integrations.vllm.runners import method_patch

_builds: "weakref.WeakKeyDictionary[Any, EngineBuild]" = weakref.WeakKeyDictionary()

# The graph modes of vLLM's dispatch a step can have run in.
GRAPH_RUNTIME_MODES = ("FULL", "PIECEWISE")


@dataclass(frozen=True)
class EngineNeeds:
    """What the steps replayed on one engine need of it, for a lean build: the CUDA graphs
    ((vLLM graph mode, padded size) pairs) and the padded token counts their forwards run at."""

    graphs: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    sizes: frozenset[int] = field(default_factory=frozenset)

    def __or__(self, other: "EngineNeeds") -> "EngineNeeds":
        return EngineNeeds(self.graphs | other.graphs, self.sizes | other.sizes)


def needs_of(step: Step, modes: str | None = None) -> EngineNeeds:
    """The graph the step was dispatched to, and the PIECEWISE graph of its size where `modes`
    (a `--mode` value) times it in vLLM's PIECEWISE graphs too (`vllm-piecewise`, `all`); for a
    step that opens a window, those of every step of the window."""
    later = [carried.graph for carried in step.later if carried.graph is not None]
    return union_of(_needs_of_dispatch(dispatch, modes) for dispatch in [step.graph, *later])


def _needs_of_dispatch(dispatch: GraphDispatch, modes: str | None) -> EngineNeeds:
    descriptor = dispatch.batch_descriptor if isinstance(dispatch.batch_descriptor, dict) else {}
    size = int(descriptor.get("num_tokens") or dispatch.num_tokens_padded or dispatch.num_tokens)  # the graph's key
    graphs = set()
    if dispatch.runtime_mode in GRAPH_RUNTIME_MODES:
        graphs.add((dispatch.runtime_mode, size))
        if modes not in (None, "reference") and ReplayMode.VLLM_PIECEWISE.value in expand_modes(modes):
            graphs.add(("PIECEWISE", size))
    return EngineNeeds(frozenset(graphs), frozenset({size}))


def union_of(needs: Iterable[EngineNeeds]) -> EngineNeeds:
    total = EngineNeeds()
    for each in needs:
        total |= each
    return total


@dataclass
class EngineBuild:
    """How a replay engine was built: "lean" (what its steps need) or "full" (as vLLM builds it)."""

    kind: str
    graphs_wanted: list[tuple[str, int]] = field(default_factory=list)
    # The (mode, size) pairs the runner was left to capture; None where it captured none (no
    # graphs on this device, or a compilation without them).
    graphs_captured: list[tuple[str, int]] | None = None
    compile_sizes: list[int] | None = None  # narrowed to these; None: as recorded
    env: dict[str, str] = field(default_factory=dict)
    seconds: float | None = None
    # Of `seconds`, the part spent importing vLLM's engine modules (the same for any way of
    # starting an engine in a fresh process; what a lean build cannot cut).
    import_seconds: float | None = None

    def to_plain(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "graphs_wanted": [list(pair) for pair in self.graphs_wanted],
            "graphs_captured": None if self.graphs_captured is None else [list(pair) for pair in self.graphs_captured],
            "compile_sizes": self.compile_sizes,
            "env": self.env,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "import_seconds": None if self.import_seconds is None else round(self.import_seconds, 3),
        }


def build_of(llm: Any) -> EngineBuild | None:
    """How `llm` was built, where tracekit built it."""
    return _builds.get(llm)


def narrowed_compile_sizes(engine_args: dict[str, Any], sizes: Collection[int]) -> list[int] | None:
    """The recorded `compile_sizes` that a step of one of `sizes` (padded token counts) runs at;
    None where nothing is dropped."""
    recorded = engine_args.get("compilation_config", {}).get("compile_sizes") or []
    kept = [size for size in recorded if isinstance(size, int) and size in sizes]
    return kept if len(kept) < len(recorded) else None


def build(engine_args: dict[str, Any], runner_kind: str | None, needs: EngineNeeds | None,
          compile_here: bool = False) -> Any:
    """Build the engine: lean, capturing only the graphs `needs` names and compiling only the
    compile sizes its steps run at; or, with `needs` None, as vLLM builds it. `compile_here`:
    the steps carry recorded kernel choices, so nothing compiled elsewhere is loaded."""
    started = time.perf_counter()
    release = installed_release()
    # What building an engine imports, timed apart: vLLM's entry point (loaded lazily, on first
    # use) and the model runners that capture graphs.
    from vllm import LLM  # noqa: F401
    capturers = classes_here(release.graph_capturers)
    imported = time.perf_counter() - started
    env = _set_engine_env(release.lean_env if needs is not None else {}, compile_here)
    if needs is None:
        llm = build_llm(engine_args, runner_kind)
        _builds[llm] = EngineBuild("full", env=env, seconds=time.perf_counter() - started, import_seconds=imported)
        return llm
    made = EngineBuild("lean", graphs_wanted=sorted(needs.graphs), env=env, import_seconds=imported)
    made.compile_sizes = narrowed_compile_sizes(engine_args, needs.sizes)
    args = engine_args
    if made.compile_sizes is not None:
        args = {**engine_args, "compilation_config": {**engine_args["compilation_config"],
                                                      "compile_sizes": made.compile_sizes}}
    with _capturing_only(capturers, release, needs.graphs, made), _collector_off_the_heap():
        llm = build_llm(args, runner_kind)
    made.seconds = time.perf_counter() - started
    _builds[llm] = made
    return llm


# vLLM's compile cache is keyed by the engine's configuration, not by Inductor's lookup table: an
# artifact another process compiled carries its kernel choices. On an H100 (vLLM 0.26, float32) a
# replay that loaded another recording's replay's artifact parted at 12 of its 15 steps; replays
# that compiled their own code under their recorded choices have all been bit-exact.
COMPILE_HERE_ENV = {"VLLM_DISABLE_COMPILE_CACHE": "1"}


def _set_engine_env(lean_env: dict[str, str], compile_here: bool) -> dict[str, str]:
    """Set the release's lean-engine variables this process does not set itself and, for steps
    with kernel choices, `COMPILE_HERE_ENV` (whatever is set); returns what was set."""
    env = {name: value for name, value in lean_env.items() if name not in os.environ}
    if compile_here:
        env.update(COMPILE_HERE_ENV)
    os.environ.update(env)
    if env:
        forget_cached_vllm_envs()
    return env


@contextmanager
def _capturing_only(capturers: list[type], release: Any, graphs: Collection[tuple[str, int]],
                    build: EngineBuild) -> Iterator[None]:
    """While the block builds an engine, its runner's `capture_model` captures `graphs` only."""
    def narrow(runner: Any) -> None:
        build.graphs_captured = release.keep_only_graphs(runner, lambda mode, size: (mode, size) in graphs)

    with ExitStack() as stack:
        for runner_class in capturers:
            stack.enter_context(method_patch.class_calls_before(runner_class, "capture_model", narrow))
        yield


@contextmanager
def _collector_off_the_heap() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
