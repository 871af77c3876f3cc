"""Issue 31, without an engine: a step's grammar mask as vLLM hands it to `sample_tokens`, and as
it reaches the logits.

The mask as applied is read back from the masked logits (`grammar.applied_mask`): checked here
against xgrammar's own kernel, the one vLLM's V1 runner masks CPU logits with. The record of
vLLM's `GrammarOutput` goes back into one; the check names the logits row, its request and
position, and the tokens a differing row allows."""

import io

import numpy as np
import pytest
import torch

from tracekit.cli.replay_report import print_report
from tracekit.format.schema import (
    GrammarRecord,
    GraphDispatch,
    KVSnapshot,
    RequestState,
    SchedulerOutputRecord,
    Step,
    StepOutputs,
)
from tracekit.integrations.seam import ObservedStep
from tracekit.integrations.vllm.records.grammar import applied_mask, unpack_mask
from tracekit.integrations.vllm.releases.installed import installed_release
from tracekit.replay.checks import check_step
from tracekit.replay.result import ReplayResult
from tracekit.replay.verdict import describe_mask_row

VOCAB = 70  # not a multiple of 32: the last word is part padding


def random_bitmask(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), 1 << 31, (rows, -(-VOCAB // 32)), dtype=torch.int64, generator=generator).to(torch.int32)


def test_the_applied_mask_is_what_xgrammar_masked():
    xgrammar = pytest.importorskip("xgrammar")
    bitmask = random_bitmask(3, seed=0)
    logits = torch.randn(3, VOCAB)
    masked = logits.clone()
    xgrammar.apply_token_bitmask_inplace(masked, bitmask)
    applied = applied_mask(masked)
    assert applied.dtype == torch.int32 and applied.shape == bitmask.shape
    allowed = unpack_mask(bitmask, VOCAB)
    assert torch.equal(unpack_mask(applied, VOCAB), allowed)
    assert torch.equal(unpack_mask(applied, VOCAB), ~torch.isneginf(masked))


def test_a_grammar_output_goes_back_as_it_came():
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.scheduled_spec_decode_tokens = {"b": [7, 8]}
    bitmask = random_bitmask(4, seed=1).numpy()
    fields = {"structured_output_request_ids": ["a", "b"], "grammar_bitmask": bitmask}
    if "num_acceptable_drafts" in GrammarOutput.__dataclass_fields__:
        fields["num_acceptable_drafts"] = [0, 2]
    release = installed_release()
    record = release.grammar_record(GrammarOutput(**fields), scheduler_output)
    assert record.rows_per_request == [1, 3] and list(record.rows_of("b")) == [1, 2, 3]
    bitmask[0, 0] ^= 1  # the record is a copy: vLLM reuses its buffer for the next step
    rebuilt = release.grammar_output(record)
    assert rebuilt.structured_output_request_ids == ["a", "b"]
    assert np.array_equal(rebuilt.grammar_bitmask[1:], bitmask[1:]) and rebuilt.grammar_bitmask[0, 0] != bitmask[0, 0]
    assert getattr(rebuilt, "num_acceptable_drafts", None) == fields.get("num_acceptable_drafts")


def test_vllm_034_gives_each_request_a_fixed_block_of_mask_rows():
    """vLLM 0.34 lays the bitmask out in blocks of `1 + num_speculative_tokens` rows a request,
    whatever its drafts this step (0.32: `1 + its drafts`); a drafted grammar step recorded under
    0.34 on an H200 was refused as a layout tracekit did not know."""
    from types import SimpleNamespace

    from tracekit.integrations.vllm.records.serialize import SerializationError
    from tracekit.integrations.vllm.releases.v0_34 import Release as Release034

    output = SimpleNamespace(structured_output_request_ids=["a", "b"], grammar_bitmask=random_bitmask(8, seed=2).numpy())
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={"b": [7, 8]})  # a drafts none, b two of k = 3
    record = Release034.grammar_record(None, output, scheduled)
    assert record.rows_per_request == [4, 4] and list(record.rows_of("b")) == [4, 5, 6, 7]
    assert torch.equal(record.bitmask, torch.from_numpy(output.grammar_bitmask))
    with pytest.raises(SerializationError, match="a layout this tracekit does not know"):
        installed_release().grammar_record(output, scheduled)  # 0.32's layout: 1 + 3 rows, not 8


def _step_with_mask(applied: torch.Tensor) -> Step:
    requests = [RequestState(req_id, [1, 2], [], [[0]], num_computed_tokens=2, num_scheduled_tokens=1)
                for req_id in ("plain", "masked")]
    logits = torch.randn(2, VOCAB)
    return Step(
        index=0, trigger="steps 0", scheduler_output=SchedulerOutputRecord(), batch_order=["plain", "masked"], requests=requests,
        input_ids=None, positions=None, kv=KVSnapshot(mode="read"),
        graph=GraphDispatch(compilation_mode="NONE", cudagraph_mode="NONE"),
        outputs=StepOutputs(logits=logits, grammar_bitmask=applied, sampled_token_ids=[[3], [4]]),
        grammar=GrammarRecord(["masked"], [1], applied[1:].clone()),
    )


def test_a_differing_row_is_named_with_its_request_and_tokens():
    recorded = applied_mask(torch.where(torch.rand(2, VOCAB) < 0.5, float("-inf"), 0.0))
    step = _step_with_mask(recorded)
    here = recorded.clone()
    here[1, 1] ^= 1 << 3  # token 35
    observed = ObservedStep(batch_order=step.batch_order, logits=step.outputs.logits, grammar_bitmask=here,
                            sampled_token_ids=[[3], [4]])
    (item,) = [item for item in check_step(observed, step) if item.name == "grammar_bitmask"]
    assert not item.bit_exact and item.float_dtype is None
    (row,) = item.details["differing_mask_rows"]
    assert (row["row"], row["req_id"], row["position"]) == (1, "masked", 0)
    allowed_before = bool(unpack_mask(recorded, VOCAB)[1, 35])
    assert (row["tokens_only_recorded"], row["tokens_only_here"]) == (([35], []) if allowed_before else ([], [35]))
    assert "request masked, its sampled token" in describe_mask_row(row)
    report = io.StringIO()  # the replay report names the row as the docs say
    print_report(ReplayResult(bundle="b.zst", step_index=0, trigger="steps 0", reference_mode="eager",
                              checks=check_step(observed, step)), report)
    assert "grammar mask row 1 (request masked, its sampled token)" in report.getvalue(), report.getvalue()

    same = ObservedStep(batch_order=step.batch_order, logits=step.outputs.logits, grammar_bitmask=recorded.clone(),
                        sampled_token_ids=[[3], [4]])
    assert [item.bit_exact for item in check_step(same, step) if item.name == "grammar_bitmask"] == [True]
    missing = ObservedStep(batch_order=step.batch_order, logits=step.outputs.logits, sampled_token_ids=[[3], [4]])
    (item,) = [item for item in check_step(missing, step) if item.name == "grammar_bitmask"]
    assert item.details == {"problem": "no grammar mask reached the replay's logits"}
