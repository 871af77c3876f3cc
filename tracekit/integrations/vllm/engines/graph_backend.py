"""The one place where tracekit's piecewise graph backend is plugged into vLLM: by qualified name,
in compilation mode 2 (DYNAMO_TRACE_ONCE), with vLLM's own CUDA graphs off so that tracekit's
backend alone captures (docs/GRAPHS.md, "Plugging the piecewise backend into vLLM", gives the code
paths, read on 0.32.0 and 0.34.0). The recorded table travels to the engine's processes in an
environment variable. vLLM is imported lazily.
"""

import json
import os
from collections.abc import Sequence
from typing import Any

from torch import fx

from tracekit.errors import UsageError
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.piecewise import PiecewiseGraphBackend
from tracekit.integrations.vllm.engines.build import forget_cached_vllm_envs

SETTINGS_ENV = "TRACEKIT_PIECEWISE_SETTINGS"
BACKEND_QUALNAME = f"{__name__}.piecewise_backend"
# vLLM's numbering of CompilationConfig.mode.
NO_COMPILATION, DYNAMO_TRACE_ONCE = 0, 2
# Besides attention, vLLM's default piecewise split also runs these eagerly: their string layer
# name argument keeps Inductor from reusing piece graphs (vLLM issue 33267).
KV_CACHE_UPDATE_OPS = ("vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update")

# Every backend `piecewise_backend` built in this process, newest last (its counters say what
# was compiled, captured, replayed and fell back).
built_backends: list[PiecewiseGraphBackend] = []


def compilation_config_for(
    mode: str, table: CaptureTable | None = None, device: str = "auto", compiler: str = "inductor"
) -> dict[str, Any]:
    """The `compilation_config` an engine needs for a replay `mode`; pass it to `vllm.LLM`.

    "eager": no compilation, no graphs. "compiled" and "graph": the recorded compilation without
    vLLM's graphs (the one-shot graph captures the forward itself). "piecewise": tracekit's backend
    capturing `table`; this also sets the environment variable that carries the table, so build
    the engine after calling it.
    """
    if mode == "eager":
        return {"mode": NO_COMPILATION, "cudagraph_mode": "NONE"}
    if mode in ("compiled", "graph"):
        return {"cudagraph_mode": "NONE"}
    if mode != "piecewise":
        raise UsageError(f"no engine compilation config for replay mode {mode!r}")
    if table is None:
        raise UsageError("piecewise replay needs the recorded capture table")
    os.environ[SETTINGS_ENV] = json.dumps(
        {"table": table.to_plain(), "device": device, "compiler": compiler}
    )
    # vLLM's AOT compile (its default with torch >= 2.10) stores the compiled forward, which must
    # then be serialisable; the piecewise backend's is not ("does not implement
    # SerializableCallable"), so the engine compiles it the plain way.
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    forget_cached_vllm_envs()
    return {"mode": DYNAMO_TRACE_ONCE, "backend": BACKEND_QUALNAME, "cudagraph_mode": "NONE"}


def piecewise_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """The `torch.compile` backend vLLM resolves from `BACKEND_QUALNAME`."""
    settings = os.environ.get(SETTINGS_ENV)
    if settings is None:
        raise UsageError(f"{BACKEND_QUALNAME} needs {SETTINGS_ENV}: use compilation_config_for()")
    settings = json.loads(settings)
    backend = PiecewiseGraphBackend(
        CaptureTable.from_plain(settings["table"]),
        splitting_ops(),
        get_device_backend(settings["device"]),
        compiler=settings["compiler"],
    )
    built_backends.append(backend)
    return backend(gm, example_inputs)


def splitting_ops() -> list[str]:
    """The ops vLLM's default piecewise compilation splits at (attention and friends)."""
    from vllm.config import CompilationConfig

    return [*CompilationConfig._attention_ops, *KV_CACHE_UPDATE_OPS]
