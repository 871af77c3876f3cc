"""The numerics-relevant facts only a live vLLM engine knows, for the environment fingerprint.

`tracekit.environment` reads versions, device and CPU ISA from torch; which attention backend
the engine picked, and on CPU which kernel ISA that backend chose, can differ between two
machines with the same versions. They are read here, from the attention layers vLLM registered.

The CPU backend's ISA is more than rounding: with "amx" (bf16 on AMX CPUs) its KV cache blocks
are laid out for AMX tiles, with "vec"/"vec16" they are not, so KV blocks recorded under one
cannot be read by the other (`kv_layout_difference`).
"""

from typing import Any

from tracekit.environment import current_environment
from tracekit.format.schema import Environment

# CPU attention kernel ISAs whose KV cache block layout is their own.
_OWN_KV_LAYOUT = ("amx",)
# Set by vLLM itself with a fresh random value in every process: never a difference that matters.
PER_PROCESS_VARS = ("VLLM_DIST_IDENT", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")


def attention_backend(runner: Any) -> str | None:
    """"NAME" or "NAME/isa" of each attention layer's backend, sorted and joined by ","."""
    config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    context = getattr(config, "static_forward_context", None) or {}
    names = set()
    for layer in context.values():
        get_backend = getattr(layer, "get_attn_backend", None)
        if get_backend is None:
            continue
        try:
            name = str(get_backend().get_name())
        except Exception:  # a layer type that cannot say: the fingerprint just lacks it
            continue
        # vLLM's CPU attention metadata builder sets the kernel ISA on each attention layer.
        isa = getattr(layer, "isa", None) or getattr(getattr(layer, "impl", None), "isa", None)
        names.add(f"{name}/{isa}" if isa else name)
    return ",".join(sorted(names)) or None


def kv_layout_difference(recorded: str | None, here: str | None) -> str | None:
    """Why KV blocks recorded under attention backend `recorded` cannot be read under `here`."""
    if recorded is None or here is None or recorded == here:
        return None
    def own_layouts(backends: str) -> set[str]:
        return {isa for backend in backends.split(",") for isa in _OWN_KV_LAYOUT if backend.endswith(f"/{isa}")}
    if own_layouts(recorded) != own_layouts(here):
        return (
            f"the recorded KV cache blocks are laid out for attention backend {recorded}, and this "
            f"engine uses {here}, which lays them out differently: replay on a machine with the same "
            "attention kernel ISA"
        )
    return None


def runner_environment(runner: Any, vllm_version: str | None) -> Environment:
    """This machine's fingerprint as seen from a live runner (device and attention backend)."""
    return current_environment(runner.device, attention_backend=attention_backend(runner), vllm_version=vllm_version,
                               per_process_vars=PER_PROCESS_VARS)
