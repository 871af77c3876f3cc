"""The replay reports say what the verdicts say, and print a bundle's own strings inert.

Built from real checks of a recorded step (traces/), no engine: a rank set whose ranks differ
only by the platform (exit 0) must not be reported NOT REPRODUCED; a trigger or bundle path
holding rich markup must come out as the literal text."""

import io
from pathlib import Path

from test_verdicts import observed_like

from tracekit.cli.rank_set_report import print_rank_set_report
from tracekit.cli.replay_report import print_report
from tracekit.format.content import load_step
from tracekit.replay.checks import check_step
from tracekit.replay.multirank import RankSetReplayResult
from tracekit.replay.result import ReplayResult

TRACES = Path(__file__).resolve().parents[2] / "traces"


def _platform_differing_rank() -> ReplayResult:
    """The AVX512 recording replayed with the AVX2 machine's numbers: a platform difference."""
    _, reference = load_step(TRACES / "tiny-llama-mixed-step.zst", None)
    _, other = load_step(TRACES / "avx2-mixed-step-eager.zst", None)
    checks = check_step(observed_like(other, reference.batch_order), reference)
    return ReplayResult(
        bundle="step.rank0.zst", step_index=reference.index, trigger=reference.trigger, reference_mode="eager",
        checks=checks, environment_differences=[{"field": "cpu_isa", "recorded": "avx512", "here": "avx2",
                                                 "affects_numerics": True}],
    )


def test_a_rank_set_within_the_platform_bound_is_not_reported_as_not_reproduced():
    rank = _platform_differing_rank()
    assert rank.verdict.name.value == "platform_difference" and rank.exit_code == 0
    result = RankSetReplayResult(bundle="step.rank0.zst", step_index=rank.step_index, trigger=rank.trigger,
                                 tensor_parallel_size=2, pipeline_parallel_size=1, ranks=[rank, rank])
    out = io.StringIO()
    print_rank_set_report(result, out)
    text = out.getvalue()
    assert result.exit_code == 0 and "NOT REPRODUCED" not in text, text
    assert "verdict platform_difference" in text
    assert result.to_plain()["verdict"] == "platform_difference" and result.to_plain()["exit_code"] == 0


def test_bundle_strings_in_the_report_header_are_inert():
    rank = _platform_differing_rank()
    rank.trigger = "when [bold red]mixed[/bold red]"
    rank.bundle = "/tmp/[link=http://x]step[/link].zst"
    out = io.StringIO()
    print_report(rank, out)
    header = out.getvalue().splitlines()[0]
    assert "[bold red]mixed[/bold red]" in header and "[link=http://x]step[/link]" in header, header


def test_mode_agreement_names_the_modes_that_part_and_the_non_finite_ones():
    from tracekit.replay.timed_modes import mode_agreement

    def ran(bit_exact, rms=0.0, finite=True):
        return {"available": True, "vs_recorded": {"bit_exact": bit_exact, "relative_rms": rms, "finite": finite}}

    assert mode_agreement({"compiled": ran(True)}) is None
    assert mode_agreement({"compiled": ran(True), "eager": ran(True), "graph": {"available": False}}) == {
        "agree": True, "bit_exact_with_recording": ["compiled", "eager"], "parted": {}, "nonfinite": []}
    disagree = mode_agreement({"compiled": ran(False, float("nan"), finite=False), "eager": ran(True)})
    assert disagree["agree"] is False and list(disagree["parted"]) == ["compiled"]
    assert disagree["nonfinite"] == ["compiled"] and disagree["bit_exact_with_recording"] == ["eager"]


def test_proposals_a_dropped_drafter_order_leaves_uncomparable_are_reported_as_not_compared():
    """A 0.34 step whose scheduler told the drafter to skip (every proposal -1), replayed by a vLLM
    without that order, which proposed: the proposals do not decide, and the report says why
    (without the dropped order, the same proposals decide and differ)."""
    _, step = load_step(TRACES / "h100-vllm026" / "v1-bf16-mtp-async-drafted.zst", None)
    skipped = step.spec_decode.proposals.clone().fill_(-1)
    step.spec_decode.proposals = skipped
    proposed = skipped + 8  # what a drafter that does not skip proposes
    for dropped in ([], ["skip_drafts=True"]):
        observed = observed_like(step, step.batch_order, proposals=proposed, drafter_orders_dropped=dropped)
        checks = check_step(observed, step)
        (item,) = [check for check in checks if check.name == "spec_decode/proposals"]
        assert not item.bit_exact and item.decides is not bool(dropped), item
        result = ReplayResult(bundle="step.zst", step_index=step.index, trigger=step.trigger, reference_mode="compiled",
                              checks=checks)
        out = io.StringIO()
        print_report(result, out)
        said = "spec_decode/proposals not compared: the recording's scheduler told its drafter skip_drafts=True"
        assert (said in out.getvalue()) is bool(dropped), out.getvalue()
