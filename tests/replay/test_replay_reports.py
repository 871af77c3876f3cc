"""The replay reports say what the verdicts say, and print a bundle's own strings inert.

Built from real checks of a recorded step (traces/), no engine: a rank set whose ranks differ
only by the platform (exit 0) must not be reported NOT REPRODUCED; a trigger or bundle path
holding rich markup must come out as the literal text."""

import io
from pathlib import Path

from test_verdicts import observed_like

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
    print_report(result, out)
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
    header = next(line for line in out.getvalue().splitlines() if line.startswith("replay "))
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


def _bit_exact_replay(**fields) -> ReplayResult:
    """The sample step replayed with its own recorded numbers."""
    _, step = load_step(TRACES / "tiny-llama-mixed-step.zst", None)
    return ReplayResult(bundle="step.zst", step_index=step.index, trigger=step.trigger, reference_mode="eager",
                        checks=check_step(observed_like(step, step.batch_order), step), **fields)


def _timed(median_us: float, spread_pct: float, timer: str = "perf_counter") -> dict:
    return {"available": True, "vs_recorded": {"bit_exact": True},
            "latency_us": {"median": median_us, "min": median_us, "p90": median_us, "sample_spread_pct": spread_pct,
                           "timer": timer}}


def _report(result: ReplayResult, needs: str | None = None) -> list[str]:
    out = io.StringIO()  # not a terminal: plain lines, never wrapped
    print_report(result, out, needs)
    return out.getvalue().splitlines()


def test_the_verdict_comes_first_then_what_the_bundle_needs():
    lines = _report(_bit_exact_replay(), needs="needs: vLLM 0.32 | cpu AVX512 | ...")
    assert lines[0].startswith("verdict bit_exact: REPRODUCED (bit-exact)") and lines[0].endswith("exit 0)")
    assert lines[1] == "needs: vLLM 0.32 | cpu AVX512 | ..."


def test_only_the_environment_differences_that_can_change_numbers_are_listed_and_no_mark_lacks_a_legend():
    differences = [
        {"field": "cpu_isa", "recorded": "AVX512", "here": "AVX2", "affects_numerics": True},
        {"field": "env TORCHINDUCTOR_CACHE_DIR", "recorded": "/a", "here": "/b", "affects_numerics": False},
        {"field": "python_version", "recorded": "3.11.7", "here": "3.11.9", "affects_numerics": False},
    ]
    text = "\n".join(_report(_bit_exact_replay(environment_differences=differences)))
    assert "cpu_isa: recorded 'AVX512', here 'AVX2'" in text
    assert "TORCHINDUCTOR_CACHE_DIR" not in text and "2 other environment difference(s)" in text
    assert " ! " not in text and "[yellow]" not in text


def test_nothing_timed_prints_no_timing_table():
    text = "\n".join(_report(_bit_exact_replay()))
    assert "forward time" not in text and "median" not in text


def test_a_ratio_is_shown_only_against_a_comparable_recorded_time_and_says_why_otherwise():
    from tracekit.replay.timed_modes import compare_with_recorded

    comparable = {"forward_us": 1000.0, "forward_timer": "perf_counter"}
    cases = [  # (recorded timing, spread): shown?, what is said
        (comparable, 3.0, True, None),
        ({**comparable, "first_of_its_size": True}, 3.0, False, "first of its padded size"),
        ({"forward_us": 1000.0}, 3.0, False, "older recorder"),
        (comparable, 193.0, True, "spread 193% (over 25%)"),
    ]
    for recorded, spread, shown, said in cases:
        modes = {"eager": _timed(2000.0, spread)}
        compare_with_recorded(modes, recorded)
        text = "\n".join(_report(_bit_exact_replay(modes=modes, recorded_timing=recorded)))
        row = next(line for line in text.splitlines() if line.startswith("eager"))
        assert ("2.00x" in row) is shown, text
        assert said is None or said in text, text
        assert modes["eager"]["ratio_to_recorded"] == 2.0  # --json keeps the number, and why it says little


def test_piped_tables_never_break_a_long_name():
    result = _bit_exact_replay()
    long_name = "kv_written/" + "model.layers.0.self_attn.attn" * 6
    result.checks[3].name = long_name
    assert any(line.startswith(long_name) for line in _report(result))


def test_a_verdict_the_report_has_no_words_for_is_shown_by_its_name_and_exit_code():
    from tracekit.cli.replay_report import print_verdict
    from tracekit.cli.terminal import console_for
    from tracekit.replay.verdict import Verdict, VerdictName

    out = io.StringIO()
    print_verdict(console_for(out), Verdict(VerdictName.CANNOT_RUN_HERE, "no such device"), None, 0.0, False)
    assert out.getvalue() == "verdict cannot_run_here: CANNOT RUN HERE (no such device; exit 3)\n"
