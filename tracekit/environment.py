"""The environment fingerprint: where a bundle was recorded, and how this machine differs.

Bit-exact replay is only promised on the same platform, so the recorder stores the versions,
device and CPU instruction set that shape the numbers, and the replayer prints every difference
before it runs. Nothing here imports vLLM: what only the engine knows (its version, its attention
backend) is handed in by the engine integration.
"""

import os
import platform
import sys
from typing import Any

from tracekit import __version__
from tracekit.format.schema import Environment

# Environment variables worth recording: they may change what a forward computes or how it runs.
RELEVANT_ENV_PREFIXES = (
    "VLLM_", "TRACEKIT_", "CUDA_", "NCCL_", "OMP_", "ASCEND_", "TORCH_", "ATEN_", "ONEDNN_", "DNNL_", "MKL_",
    "CUBLAS_", "NVIDIA_TF32", "TORCHINDUCTOR_", "TRITON_",
)
# What bundles recorded before `Environment.env_prefixes` was: Inductor's and Triton's variables
# were not among them.
EARLIER_ENV_PREFIXES = tuple(prefix for prefix in RELEVANT_ENV_PREFIXES if prefix not in ("TORCHINDUCTOR_", "TRITON_"))
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")

# Fields whose difference makes bit-exactness unlikely; the rest are informational. The torch and
# vLLM versions carry their build tags ("2.13.0+cpu"). `num_threads` counts on CPU only, where the
# thread count can change how a reduction is split.
NUMERIC_FIELDS = (
    "vllm_version", "torch_version", "device_kind", "device_name", "cpu_isa", "gpu_capability",
    "attention_backend", "num_threads",
)
# Environment variables that choose a kernel, a precision, a backend, a thread count or the
# compilation: what the numbers may depend on. A name marked so whose value is a location
# (a directory, a file, a host) is not: it only says where things are.
NUMERICS_ENV_MARKERS = (
    "ATTENTION", "ATTN", "BACKEND", "KERNEL", "GEMM", "MOE", "FLASH", "SAMPLER", "TF32", "CUBLAS", "CUDNN",
    "DETERMINISTIC", "BATCH_INVARIANT", "NUM_THREADS", "OMP_", "MKL_", "DNNL", "ONEDNN", "FP8", "FP4", "DTYPE",
    "PRECISION", "COMPILE", "INDUCTOR", "CUDAGRAPH", "TRITON", "MODEL_RUNNER", "ALL_REDUCE", "ALLREDUCE",
    "NCCL_ALGO", "NCCL_PROTO", "KVCACHE", "SSM", "SHARED_EXPERTS", "CPU_CAPABILITY",
)
LOCATION_SUFFIXES = ("_DIR", "_PATH", "_ROOT", "_FILE", "_HOST", "_IP", "_PORT", "_URL", "_NAME")
# Nor is one whose value is an amount of memory (`VLLM_CPU_KVCACHE_SPACE`): it sizes a cache whose
# recorded geometry a replay restores, and changes no number.
AMOUNT_SUFFIXES = ("_SPACE", "_BYTES")


def numerics_relevant_env(name: str) -> bool:
    return (any(marker in name for marker in NUMERICS_ENV_MARKERS)
            and not name.endswith(LOCATION_SUFFIXES) and not name.endswith(AMOUNT_SUFFIXES))


def current_environment(device: Any = None, attention_backend: str | None = None,
                        vllm_version: str | None = None, per_process_vars: tuple[str, ...] = ()) -> Environment:
    """This process's fingerprint; `attention_backend`, `vllm_version` and the variables the engine
    sets to a fresh value in every process (`per_process_vars`, never a difference that matters)
    come from the engine (see `tracekit.integrations.vllm.engines.platform_facts`)."""
    import torch

    device = torch.device(device or "cpu")
    environment = Environment(
        tracekit_version=__version__,
        vllm_version=vllm_version,
        torch_version=torch.__version__,
        python_version=sys.version.split()[0],
        platform=platform.platform(),
        device_kind=device.type,
        device_name=platform.processor() or platform.machine(),
        cpu_isa=torch.backends.cpu.get_cpu_capability(),
        attention_backend=attention_backend,
        num_threads=torch.get_num_threads(),
        env_vars={
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith(RELEVANT_ENV_PREFIXES)
            and not any(marker in name for marker in SECRET_MARKERS)
            and name not in per_process_vars
        },
        env_prefixes=list(RELEVANT_ENV_PREFIXES),
    )
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        environment.device_name = torch.cuda.get_device_name(device)
        environment.gpu_capability = f"sm_{major}{minor}"
    elif device.type == "npu":
        environment.device_name = torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    return environment


def environment_differences(recorded: Environment, here: Environment) -> list[tuple[str, Any, Any, bool]]:
    """(field, recorded, here, affects_numerics) for every field that differs, env vars included.
    A field an older bundle did not record (None), or a variable outside the prefixes it looked
    at, is not a difference."""
    differences = []
    for name in ("tracekit_version", *NUMERIC_FIELDS, "python_version", "platform"):
        before, now = getattr(recorded, name), getattr(here, name)
        if before != now and not (name in _ADDED_FIELDS and before is None):
            numeric = recorded.device_kind == "cpu" if name == "num_threads" else name in NUMERIC_FIELDS
            differences.append((name, before, now, numeric))
    looked_at = tuple(set(recorded.env_prefixes or EARLIER_ENV_PREFIXES) & set(here.env_prefixes or RELEVANT_ENV_PREFIXES))
    for name in sorted(set(recorded.env_vars) | set(here.env_vars)):
        if not name.startswith(looked_at):
            continue
        before, now = recorded.env_vars.get(name), here.env_vars.get(name)
        if before != now:
            differences.append((f"env {name}", before, now, numerics_relevant_env(name)))
    return differences


def environment_records(recorded: Environment, here: Environment,
                        set_by_tracekit: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every difference between the recording machine and this one, as a replay reports it, less
    the variables tracekit itself set here to build the engine."""
    set_by_tracekit = set_by_tracekit or {}
    return [
        {"field": name, "recorded": before, "here": now, "affects_numerics": numeric}
        for name, before, now, numeric in environment_differences(recorded, here)
        if not (name.startswith("env ") and set_by_tracekit.get(name.removeprefix("env ")) == now)
    ]


# Fields added after the first bundles were recorded: absent there, so unknown rather than different.
_ADDED_FIELDS = ("attention_backend", "num_threads")


def numerics_summary(environment: Environment) -> dict[str, Any]:
    """The recorded facts that shape the numbers, for `tracekit inspect`."""
    summary = {name: getattr(environment, name) for name in NUMERIC_FIELDS}
    summary["env_vars"] = {k: v for k, v in environment.env_vars.items() if numerics_relevant_env(k)}
    return summary
