"""A graph step runs more rows than it has tokens: the bundle keeps the padding rows, the replay
compares real rows (which decide) and padding rows (which do not) apart, names the requests
whose rows moved, and says what a padding row may have done. The engine's dispatch of the step,
recorded and replayed, is set side by side. Built on a real recorded step (traces/), its rows
padded the way a FULL graph of a larger size pads them."""

import copy
from pathlib import Path

import torch
from test_verdicts import observed_like

from tracekit.format.content import load_step
from tracekit.format.schema import GraphDispatch
from tracekit.replay import dispatch
from tracekit.replay.checks import check_step, first_divergence, padding_findings
from tracekit.replay.verdict import VerdictName, decide

TRACE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"
PADDING = 8


def padded_step():
    """The recorded mixed step as if it had run at a size 8 rows larger, padding rows holding
    what such rows hold: stale ids and positions, and whatever the graph computed for them."""
    _, step = load_step(TRACE, None)
    step = copy.deepcopy(step)
    step.graph.num_tokens = int(step.input_ids.shape[0])
    step.graph.num_tokens_padded = step.graph.num_tokens + PADDING
    step.input_ids = torch.cat([step.input_ids, torch.arange(PADDING, dtype=step.input_ids.dtype) + 7])
    step.positions = torch.cat([step.positions, torch.zeros(PADDING, dtype=step.positions.dtype)])
    hidden = step.outputs.hidden_states
    step.outputs.hidden_states = torch.cat([hidden, torch.randn(PADDING, hidden.shape[1], dtype=hidden.dtype)])
    return step


def test_padding_rows_are_compared_apart_and_do_not_decide():
    step = padded_step()
    other_padding = step.outputs.hidden_states.clone()
    other_padding[step.num_real_rows:] += 1.0  # the graph's padding rows came out otherwise
    items = check_step(observed_like(step, step.batch_order, hidden_states=other_padding), step)
    by_name = {item.name: item for item in items}
    assert by_name["hidden_states"].bit_exact and by_name["input_ids"].bit_exact
    padding = by_name["hidden_states/padding"]
    assert not padding.bit_exact and not padding.decides and padding.details["rows"] == [step.num_real_rows,
                                                                                         step.num_real_rows + PADDING]
    assert decide(items, []).name == VerdictName.BIT_EXACT
    assert first_divergence(items) is None


def test_real_rows_that_move_are_named_by_request():
    step = padded_step()
    moved = step.outputs.hidden_states.clone()
    last = step.batch_order[-1]
    moved[step.num_real_rows - 1] += 0.25  # the last real row belongs to the last request
    items = check_step(observed_like(step, step.batch_order, hidden_states=moved), step)
    hidden = next(item for item in items if item.name == "hidden_states")
    assert not hidden.bit_exact and list(hidden.details["requests_moved"]) == [last]
    assert decide(items, []).name == VerdictName.DIVERGED


def test_a_nan_in_a_padding_row_is_named_and_so_is_a_stray_kv_write():
    step = padded_step()
    phantom = step.outputs.hidden_states.clone()
    phantom[step.num_real_rows + 2, 0] = float("nan")
    observed = observed_like(step, step.batch_order, hidden_states=phantom,
                             kv_changed_elsewhere=[[4000]])
    findings = padding_findings(observed, step)
    assert any("replayed hidden states: 1 of 8 padding row(s) hold NaN/inf" in line and "real rows are finite" in line
               for line in findings), findings
    assert any("[4000]" in line and "no token of the step owns" in line for line in findings), findings


def _dispatch(**changes) -> GraphDispatch:
    base = dict(compilation_mode="VLLM_COMPILE", cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8],
                runtime_mode="FULL", num_tokens=5, num_tokens_padded=8,
                attention={"FlashAttentionMetadata": {"max_seq_len": 300, "max_query_len": 1}})
    return GraphDispatch(**{**base, **changes})


def test_the_same_dispatch_has_no_differences():
    audited = dispatch.audit(_dispatch(), _dispatch())
    assert audited["differences"] == [] and audited["attention_differences"] == []
    assert dispatch.same_graph(audited)


def test_another_graph_size_and_attention_split_are_named():
    audited = dispatch.audit(_dispatch(), _dispatch(
        runtime_mode="PIECEWISE", num_tokens_padded=16,
        attention={"FlashAttentionMetadata": {"max_seq_len": 296, "max_query_len": 1}}))
    assert "runtime_mode: recorded 'FULL', here 'PIECEWISE'" in audited["differences"]
    assert "num_tokens_padded: recorded 8, here 16" in audited["differences"]
    assert audited["attention_differences"] == [
        "attention FlashAttentionMetadata.max_seq_len: recorded 300, here 296"]
    assert not dispatch.same_graph(audited)


def test_a_bundle_without_attention_metadata_compares_none():
    audited = dispatch.audit(_dispatch(attention=None), _dispatch())
    assert audited["attention_differences"] == []


class _FlashAttentionMetadata:
    """The fields of vLLM's FlashAttentionMetadata that its summary reads for FA3's scheduler."""

    def __init__(self, seq_lens: list[int], scheduler_metadata: torch.Tensor):
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.scheduler_metadata = scheduler_metadata


def _fa3_scheduler_metadata(requests: int, vectors: int, padding: int) -> torch.Tensor:
    """FA3's layout: `vectors` per-request vectors of round_up(requests, 4) entries, then the tile
    counter; the live entries are a function of the request, the padding is `padding`."""
    padded = -(-requests // 4) * 4
    metadata = torch.full((vectors * padded + 1,), padding, dtype=torch.int32)
    for vector in range(vectors):
        metadata[vector * padded : vector * padded + requests] = torch.arange(requests) + 10 * vector
    metadata[-1] = 0
    return metadata


def test_fa3_scheduler_padding_is_left_out_of_the_digest_and_live_entries_are_not():
    from tracekit.integrations.vllm.runners.runner_state import attention_summary

    def summary(metadata: torch.Tensor) -> str:
        return attention_summary({"layer": _FlashAttentionMetadata([7] * 6, metadata)})[
            "_FlashAttentionMetadata"]["scheduler_metadata"]

    # 6 requests pad to 8 per vector: 3 vectors and the counter are 3 * 8 + 1 = 25 entries, as the
    # H200's PIECEWISE mixed step had; entries 6 and 7 of each vector are what the allocator left.
    fresh, reused = _fa3_scheduler_metadata(6, 3, 0), _fa3_scheduler_metadata(6, 3, -123)
    assert fresh.numel() == 3 * 8 + 1
    assert summary(fresh) == summary(reused) and summary(fresh).startswith("int32[25]:live:")
    moved = fresh.clone()
    moved[8 + 2] += 1  # a live entry of the second vector: another split of the work
    assert summary(moved) != summary(fresh)


def test_a_digest_of_another_kind_is_compared_by_shape_alone():
    def audited(recorded: str, here: str) -> list[str]:
        return dispatch.audit(
            _dispatch(attention={"FlashAttentionMetadata": {"scheduler_metadata": recorded}}),
            _dispatch(attention={"FlashAttentionMetadata": {"scheduler_metadata": here}}))["attention_differences"]

    assert audited("int32[25]:00ff00ff00ff00ff", "int32[25]:live:1234123412341234") == []
    assert audited("int32[25]:00ff00ff00ff00ff", "int32[33]:live:1234123412341234") != []
    assert audited("int32[25]:live:00ff00ff00ff00ff", "int32[25]:live:1234123412341234") != []
