"""Building in-process vLLM engines and reaching their model runner.

A bundle must rebuild the engine that recorded it on another machine: the recorder reads the
settings that shape the forward back out of the live `VllmConfig` (the release's
`engine_args_from_config`: this works for an `LLM` the user built, for `tracekit record` and for
`vllm serve` alike), and a replay builds an `LLM` from them here, with its engine core in this
process so that its model runner can be driven. `build_llm` is the one place an `LLM` is made.
"""

import math
import os
import sys
from typing import Any

from tracekit.errors import CannotRunHere, UsageError
from tracekit.integrations.vllm.engines import ranks
from tracekit.integrations.vllm.releases.installed import installed_release

# In-process engine core: the model runner lives in this process and can be reached.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The environment variables that put an engine's compilation or kernels in a deterministic mode,
# with the Inductor config attribute each sets. Without Inductor's, every process picks some
# kernel configs by timing them, which changes float rounding: two runs of one float32 compiled
# engine on an H200 (vLLM 0.26) already differ from their first step on. A replay sets the
# recorded ones (this process's own setting wins).
DETERMINISM_VARIABLES = {
    "TORCHINDUCTOR_DETERMINISTIC": "deterministic",
    "TORCHINDUCTOR_BATCH_INVARIANT": "batch_invariant",
    "VLLM_BATCH_INVARIANT": None,
}
# Every attribute of vLLM's LLM and engine objects this module touches.
FOREIGN_ATTRIBUTES = frozenset({
    "llm_engine", "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "reset_prefix_cache",
    "shutdown", "generate", "add_cli_args", "parse_known_args",
})


def apply_recorded_determinism(recorded_env: dict[str, str]) -> list[str]:
    """Set the recorded `DETERMINISM_VARIABLES` this process does not set itself, before an engine
    is built (on Inductor's config too where it was imported: it reads them at import); returns
    them as NAME=VALUE."""
    applied = []
    for name, inductor_attribute in DETERMINISM_VARIABLES.items():
        value = recorded_env.get(name)
        if value is None or name in os.environ:
            continue
        os.environ[name] = value
        applied.append(f"{name}={value}")
        inductor_config = sys.modules.get("torch._inductor.config")
        if inductor_attribute is not None and inductor_config is not None:
            setattr(inductor_config, inductor_attribute, value == "1")
    return applied


def forget_cached_vllm_envs() -> None:
    """vLLM caches its environment variables once an engine has started (`enable_envs_cache`,
    0.26 to 0.34); the next engine built in this process must see the ones set since."""
    reset = getattr(sys.modules.get("vllm.envs"), "disable_envs_cache", None)
    if reset is not None:
        reset()


def build_llm(engine_args: dict[str, Any], runner_kind: str | None = None) -> Any:
    """Start an in-process engine from recorded (or user) `EngineArgs` values; `runner_kind`
    ("v1" or "v2") picks vLLM's model runner, refused (exit 3) where it cannot be built."""
    os.environ.update(IN_PROCESS_ENV)
    world_size = int(engine_args.get("tensor_parallel_size") or 1) * int(engine_args.get("pipeline_parallel_size") or 1)
    ranks.default_cpu_thread_binding(world_size)
    ranks.keep_multicast_off(world_size)
    release = installed_release()
    if runner_kind is not None:
        os.environ.update(release.runner_env(runner_kind))
        release.require_buildable(runner_kind)
    engine_args = release.adopt_engine_args(engine_args)  # they may have been recorded under another release
    if world_size == 1:
        engine_args = within_free_memory(engine_args)
    from vllm import LLM

    try:
        return LLM(**engine_args)
    except (TypeError, ValueError) as error:
        raise CannotRunHere(f"vLLM refused the engine arguments: {error}") from error


# The engine arguments that give the KV cache's size outright: vLLM then sizes nothing from
# `gpu_memory_utilization`, which only feeds its start-up check.
_KV_CACHE_SIZED_BY = ("num_gpu_blocks_override", "kv_cache_memory_bytes")
# What the card's free memory may lose between this reading and vLLM's own: the engine process's
# CUDA context, and engines starting beside this one (a free-memory reading less 0.1% was refused
# on an H200 where nine replays started at once: 136.9 GiB free at vLLM's check, 0.984 x 139.8
# asked). A tenth of the card, or half of what is free where less is (a replay beside a live
# server holding 0.92 of an H100 was refused with a tenth): the budget is unused either way.
_HEADROOM = 0.1
_MOST_ASKED = 0.9  # never more than vLLM's own default would ask


def within_free_memory(engine_args: dict[str, Any], free_and_total: tuple[int, int] | None = None) -> dict[str, Any]:
    """The engine arguments with a `gpu_memory_utilization` the card's free memory covers, where
    the KV cache's size is given and the user set none. Why: vLLM refuses to start when free memory
    is below `gpu_memory_utilization` x total (0.9, or 0.92 in 0.34 when the extensible cache is
    off, as a given size turns it), though a given cache size makes the budget unused — so a replay
    beside any other process on the card (another replay, a live server) would be refused."""
    if "gpu_memory_utilization" in engine_args or not any(engine_args.get(name) for name in _KV_CACHE_SIZED_BY):
        return engine_args
    if free_and_total is None:
        import torch

        if not torch.cuda.is_available():
            return engine_args
        free_and_total = torch.cuda.mem_get_info()
    free, total = free_and_total
    spare = min(_HEADROOM * total, free / 2)
    utilization = min(_MOST_ASKED, math.floor((free - spare) / total * 1000) / 1000)
    if utilization <= 0:
        return engine_args  # too little free: vLLM's own refusal says so
    return {**engine_args, "gpu_memory_utilization": utilization}


def find_runner(llm: Any) -> Any:
    """The model runner of an in-process `LLM`, or a clear refusal."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    inner = getattr(engine_core, "engine_core", None)  # InprocClient -> EngineCore
    executor = getattr(inner, "model_executor", None) or getattr(
        llm.llm_engine, "model_executor", None
    )
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise UsageError(
            "cannot reach the model runner: it runs in another process (the engine core's, or a "
            "tensor-parallel worker's). Record with tracekit.record.api.recording (it arms every "
            "worker), set VLLM_ENABLE_V1_MULTIPROCESSING=0 before building a one-rank LLM, or record "
            "through the vLLM plugin (TRACEKIT_RECORD_OUTPUT=... vllm serve ...)"
        )
    return runner


def parse_engine_cli_args(argv: list[str]) -> dict[str, Any]:
    """`--max-model-len 1024 --enforce-eager ...` parsed by vLLM's own `EngineArgs` parser, as
    the keyword values that differ from vLLM's defaults."""
    if not argv:
        return {}
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="tracekit", add_help=False))
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except SystemExit as error:
        raise UsageError(f"bad engine arguments: {' '.join(argv)}") from error
    if unknown:
        raise UsageError(f"unknown engine argument(s): {' '.join(unknown)}")
    defaults, _ = parser.parse_known_args([])
    return {
        name: value
        for name, value in vars(namespace).items()
        if name in {item.name for item in dataclasses.fields(EngineArgs)} and value != getattr(defaults, name, None)
    }


def generate(llm: Any, prompts: list[str | list[int]], sampling: list[dict[str, Any]],
             loras: list[dict[str, Any] | None] | None = None) -> list[Any]:
    """`llm.generate` of text prompts or token-id prompts with `SamplingParams` keyword values
    (`structured_outputs` as a map of `StructuredOutputsParams` fields: `{"json": {...}}`,
    `{"choice": [...]}`, `{"regex": "..."}`) and, per request, a LoRA adapter (`{"name", "path"}`,
    optionally `"id"`: the same name keeps one id). A bad field is a usage error."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    inputs = [TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt for prompt in prompts]
    try:
        params = []
        for fields in sampling:
            grammar = fields.get("structured_outputs")
            if isinstance(grammar, dict):
                fields = {**fields, "structured_outputs": StructuredOutputsParams(**grammar)}
            params.append(SamplingParams(**fields))
    except (TypeError, ValueError) as error:
        raise UsageError(f"bad sampling parameters: {error}") from error
    return llm.generate(inputs, params, use_tqdm=False, lora_request=_lora_requests(loras or [None] * len(prompts)))


# LoRA adapter name -> the id vLLM knows it by in this process (vLLM keys loaded adapters by id).
_lora_ids: dict[str, int] = {}


def _lora_requests(loras: list[dict[str, Any] | None]) -> list[Any] | None:
    """vLLM's LoRARequest of each request's adapter (`{"name", "path", "id"?}`), None without one;
    an adapter keeps one id in a process, however many calls name it."""
    from vllm.lora.request import LoRARequest

    if not any(loras):
        return None
    requests = []
    for lora in loras:
        if lora is None:
            requests.append(None)
            continue
        if not (isinstance(lora, dict) and isinstance(lora.get("name"), str) and isinstance(lora.get("path"), str)):
            raise UsageError(f"bad lora {lora!r}: give {{\"name\": ..., \"path\": ...}}")
        int_id = _lora_ids.setdefault(lora["name"], int(lora.get("id") or len(_lora_ids) + 1))
        requests.append(LoRARequest(lora_name=lora["name"], lora_int_id=int_id, lora_path=lora["path"]))
    return requests


def adapter_of(llm: Any) -> Any:
    """The installed release's adapter for the model runner of an in-process `LLM`."""
    return installed_release().adapter_for(find_runner(llm))


def release_llm(llm: Any) -> None:
    """Shut an in-process engine down and give its memory back, before another is built."""
    import gc

    import torch

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
