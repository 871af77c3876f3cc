"""Building the engine a bundle was recorded with, here: the one builder every replay uses.

A single-rank replay, a multi-rank replay, a suite's engine per configuration and `shrink`'s
trials all need the same thing: the recorded engine arguments, with the weights found on this
machine (checked against the recorded fingerprint) and the user's overrides on top, built with
the recorded model runner kind.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.errors import CannotRunHere
from tracekit.format.schema import EngineConfig, Environment, Step
from tracekit.graphs.device import default_device
from tracekit.graphs.modes import ReplayMode, expand_modes
from tracekit.integrations.vllm import engine as vllm_engine
from tracekit.integrations.vllm import lean_build
from tracekit.models import tiny_model_path

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
    (a `--mode` value) times it in vLLM's PIECEWISE graphs too (`vllm-piecewise`, `all`)."""
    dispatch = step.graph
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


def require_device_of(recorded: Environment) -> None:
    """Refuse (exit 3) a bundle recorded on a kind of device this machine lacks: its KV caches,
    kernels and graphs exist only there."""
    here = default_device()
    if recorded.device_kind != here:
        name = f" ({recorded.device_name})" if recorded.device_name else ""
        engine = "a CPU engine" if here == "cpu" else f"a {here} engine"
        raise CannotRunHere(
            f"the bundle was recorded on a {recorded.device_kind} device{name}, and vLLM here builds {engine}, "
            f"whose KV cache, kernels and graphs differ: replay it on a {recorded.device_kind} machine"
        )


def resolve_model(engine: EngineConfig, model: str | None, allow_weights_mismatch: bool) -> str:
    """Where the weights are here, checked against the recorded fingerprint (exit 3 if not)."""
    recorded = engine.model
    load_format = engine.engine_args.get("load_format")
    if model is None:
        model = recorded.path
        if not Path(model).exists() and recorded.weights_fingerprint == vllm_engine.weights_fingerprint(
            tiny_model_path(), load_format
        ):
            model = tiny_model_path()  # recorded on another machine with tracekit's embedded model
    if recorded.weights_fingerprint is None or allow_weights_mismatch:
        return model
    if not Path(model).exists():
        raise CannotRunHere(f"model weights not found at {model}; pass --model PATH")
    here = vllm_engine.weights_fingerprint(model, load_format)
    if here != recorded.weights_fingerprint:
        raise CannotRunHere(
            f"weights at {model} differ from the recorded ones ({here} vs {recorded.weights_fingerprint}); "
            "pass --allow-weights-mismatch to replay anyway"
        )
    return model


def replay_engine_args(engine: EngineConfig, model: str | None, allow_weights_mismatch: bool,
                       overrides: dict[str, Any]) -> dict[str, Any]:
    """The engine arguments of the replay engine: recorded, weights resolved, overrides on top."""
    args = dict(engine.engine_args)
    args["model"] = resolve_model(engine, model, allow_weights_mismatch)
    if args.get("tokenizer") == engine.model.path:
        args["tokenizer"] = args["model"]
    if overrides.get("enforce_eager"):
        args["compilation_config"] = {**args.get("compilation_config", {}), "mode": 0}
    return {**args, **overrides}


def build_replay_engine(engine: EngineConfig, model: str | None = None, allow_weights_mismatch: bool = False,
                        overrides: dict[str, Any] | None = None, recorded: Environment | None = None,
                        lean: EngineNeeds | None = None) -> Any:
    """The engine a bundle was recorded with, rebuilt here (weights checked: exit 3 if not), in
    the deterministic modes the recording engine ran in (`recorded`'s environment variables):
    built as vLLM builds it, or, given the steps' `lean` needs, only with what they need
    (`tracekit.integrations.vllm.lean_build`)."""
    args = replay_engine_args(engine, model, allow_weights_mismatch, dict(overrides or {}))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if recorded is not None:
        vllm_engine.apply_recorded_determinism(recorded.env_vars)
    if lean is None:
        return lean_build.build_llm(args, engine.runner, None, set())
    return lean_build.build_llm(args, engine.runner, set(lean.graphs), set(lean.sizes))
