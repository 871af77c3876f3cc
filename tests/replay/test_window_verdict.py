"""A window's verdict (issue 32), from its steps' checks alone: the first step and item that part
name it, a platform difference stays one, and a window whose last step raised when recorded ends
in that step's error verdict unless a step before it parted."""

from tracekit.replay.checks import CheckedItem
from tracekit.replay.result import ReplayResult, SequenceFacts

CPU_ISA = [{"field": "cpu_isa", "recorded": "AVX2", "here": "AVX512", "affects_numerics": True}]


def _step(index: int, *items: CheckedItem, error: bool = False, differences=()) -> ReplayResult:
    return ReplayResult(bundle="w.zst", step_index=index, trigger="steps 4", reference_mode="eager",
                        checks=list(items), error_step=error, environment_differences=list(differences))


def _exact(name: str, dtype: str | None = None) -> CheckedItem:
    return CheckedItem(name, True, True, {}, dtype)


def _parted(name: str, dtype: str | None = None, **details) -> CheckedItem:
    return CheckedItem(name, False, False, details, dtype)


def _window(*steps: ReplayResult) -> ReplayResult:
    return ReplayResult.of_steps(list(steps), SequenceFacts(requested=len(steps), recorded=[s.step_index for s in steps],
                                                            rebuilt=[steps[0].step_index]))


def test_every_step_bit_exact_is_a_bit_exact_window():
    window = _window(_step(4, _exact("input_ids")), _step(5, _exact("input_ids"), _exact("logits", "float32")))
    assert window.verdict.name.value == "bit_exact" and window.exit_code == 0 and window.first_divergence is None


def test_the_first_step_and_item_that_part_name_the_verdict():
    window = _window(_step(4, _exact("input_ids")), _step(5, _exact("input_ids"), _parted("hidden_states", "float32")),
                     _step(6, _parted("input_ids")))
    assert window.verdict.name.value == "diverged" and window.exit_code == 1
    assert window.first_divergence == "step 5/hidden_states"
    assert window.step_records()[1]["window"] == {
        "first_step": 4, "steps": [4, 5, 6], "requested": 3, "rebuilt": [4], "from_step": None, "not_run": [],
        "verdict": "diverged", "first_divergence": "step 5/hidden_states", "position": 1, "state": "carried"}


def test_a_platform_difference_within_bounds_is_one_for_the_window():
    small = _parted("logits", "float32", max_abs=1e-7, relative_rms=1e-8, max_abs_vs_rms=1e-7)
    window = _window(_step(4, _exact("input_ids"), differences=CPU_ISA), _step(5, small, differences=CPU_ISA))
    assert window.verdict.name.value == "platform_difference"


def test_a_recorded_failure_at_the_end_decides_unless_a_step_before_parted():
    raised = CheckedItem("error", True, True, {"raised": "RuntimeError: boom"})
    reproduced = _window(_step(4, _exact("input_ids")), _step(5, raised, error=True))
    assert reproduced.verdict.name.value == "error_reproduced" and reproduced.exit_code == 0
    assert reproduced.verdict.reason.startswith("step 5: ")
    missed = _window(_step(4, _exact("input_ids")), _step(5, _parted("error"), error=True))
    assert missed.verdict.name.value == "error_not_reproduced" and missed.exit_code == 1
    parted_before = _window(_step(4, _parted("sampled_token_ids")), _step(5, raised, error=True))
    assert parted_before.verdict.name.value == "diverged" and parted_before.first_divergence == "step 4/sampled_token_ids"


def test_a_compiled_step_that_parts_by_rounding_says_what_the_kernels_had_to_do_with_it():
    """One process ran every step: its Inductor kernels are held against the recorded choices
    once, and each compiled step that parted by float rounding alone says so, as a single step's
    report does."""
    import dataclasses
    from pathlib import Path

    from tracekit.format.content import load_step
    from tracekit.format.schema import KernelChoice
    from tracekit.graphs import kernel_choices
    from tracekit.replay.replayer import step_result

    content, step = load_step(Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst", None)
    choice = KernelChoice("triton_red_fused_0", "0" * 64, {"XBLOCK": 1, "num_warps": 2, "num_stages": 1})
    content = dataclasses.replace(content, engine=dataclasses.replace(content.engine, kernel_choices=[choice]))
    kernels = kernel_choices.compare(content.engine.kernel_choices, [], kernel_choices.ChoicesApplied())
    shared = {"bundle": "w.zst", "reference_mode": "compiled", "kernel_choices": kernels}
    exact = step_result(step, None, [_exact("input_ids"), _exact("hidden_states", "bfloat16")], content, shared)
    # (a later step's digest of its KV writes parts with its floats: it does not make them discrete)
    parted = step_result(dataclasses.replace(step, index=5), None,
                         [_exact("input_ids"), CheckedItem("kv_written", False, False, {}, digest_only=True),
                          _parted("hidden_states", "bfloat16")], content, shared)
    window = _window(exact, parted)
    assert window.to_plain()["kernel_choices"] == kernels
    assert not window.steps[0].notes
    (note,) = window.steps[1].notes
    assert "none of the 1 kernel choices the bundle records met a kernel autotuned or configured" in note
