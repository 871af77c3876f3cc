"""The numerics-relevant facts only a live vLLM engine knows, for the environment fingerprint.

`tracekit.environment` reads versions, device and CPU ISA from torch; which attention backend
the engine picked (it can differ between two machines with the same versions) is read here,
from the attention layers vLLM registered for the runner.
"""

from typing import Any

from tracekit.environment import current_environment
from tracekit.format.schema import Environment


def attention_backend(runner: Any) -> str | None:
    """The attention backend names of the runner's attention layers, sorted and joined by ","."""
    config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    context = getattr(config, "static_forward_context", None) or {}
    names = set()
    for layer in context.values():
        get_backend = getattr(layer, "get_attn_backend", None)
        if get_backend is not None:
            try:
                names.add(str(get_backend().get_name()))
            except Exception:  # a layer type that cannot say: the fingerprint just lacks it
                continue
    return ",".join(sorted(names)) or None


def runner_environment(runner: Any) -> Environment:
    """This machine's fingerprint as seen from a live runner (device and attention backend)."""
    return current_environment(runner.device, attention_backend=attention_backend(runner))
