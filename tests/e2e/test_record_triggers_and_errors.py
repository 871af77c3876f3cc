"""Issue 3: event triggers and refusals of `tracekit record`.

The exception and non-finite triggers are exercised by breaking a real forward inside a live
engine (see `engine_scripts/recorder_behaviour.py`); bad trigger expressions and unwritable
outputs must be refused with one readable line and exit 2 before any engine starts."""

import sys

import pytest
import torch
from e2e_support import error_lines, run

from tracekit.format.content import load_step


@pytest.mark.slow
def test_exception_trigger_keeps_the_failing_steps_inputs_and_error(recorder_behaviour):
    failing_step = recorder_behaviour["inject_at_call"] - 1  # steps count from 0 after arming
    assert recorder_behaviour["exception_raised"] == f"RuntimeError: {recorder_behaviour['injected_error']}"
    assert not recorder_behaviour["exception_failures"]
    (path,) = recorder_behaviour["exception_written"]
    _, step = load_step(path, None)
    assert step.index == failing_step and step.trigger == "exception"
    assert step.error["type"] == "RuntimeError" and step.error["message"] == recorder_behaviour["injected_error"]
    assert "Traceback" in step.error["traceback"] and step.error["phase"] == "forward"
    assert step.outputs is None
    assert len(step.input_ids) == len(step.positions) == sum(r.num_scheduled_tokens for r in step.requests) > 0
    (group,) = step.kv.groups
    assert group.saved_block_ids and all(t.shape[0] == len(group.saved_block_ids) for t in group.before.values())
    assert group.after == {}, "a forward that raised wrote nothing worth keeping"


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["prepare", "logits", "sampling", "bookkeeping"])
def test_a_failure_in_any_phase_is_recorded_with_that_phase(recorder_behaviour, phase):
    """Each phase of a step broken in turn on the live runner: the recorder armed on exceptions
    keeps the step, its error and the phase it failed in; the engine survives to the next."""
    outcome = recorder_behaviour["phase_faults"][phase]
    assert outcome["raised"] == f"injected failure in {phase}" and not outcome["failures"], outcome
    (path,) = outcome["written"]
    _, step = load_step(path, None)
    assert step.trigger == "exception" and step.error["phase"] == phase, step.error
    assert step.error["message"] == f"injected failure in {phase}"
    assert step.kv.groups[0].before and step.requests  # what the forward would read, taken intact
    # a step that failed preparing its inputs has none yet: its replay prepares them again
    assert (step.input_ids is None) == (phase == "prepare")


@pytest.mark.slow
@pytest.mark.parametrize("arming", ["marked", "copied"])
def test_a_lost_device_context_met_first_by_the_recorder_still_leaves_the_step(recorder_behaviour, arming):
    """A device-side assert poisons the context for every later device call, the recorder's
    included: its own call in the step (the non-finite check's query; the wait for a copied
    step's copies) may meet the error before the engine's does. The recorder stays armed, the
    engine sees its own error, and the failed step is kept from host memory (`--kv recompute`)."""
    outcome = recorder_behaviour["lost_context"][arming]
    lost = recorder_behaviour["lost_context_error"]
    assert outcome["raised"] == lost and not outcome["failures"], outcome
    (path,) = outcome["written"]
    _, step = load_step(path, None)
    assert step.trigger == ("exception" if arming == "marked" else "steps 0:"), step.trigger
    assert step.error["message"] == lost and step.error["phase"] == "sampling"
    assert step.kv.mode == "recompute" and step.input_ids is None and step.outputs is None
    assert step.requests and all(not group.before for group in step.kv.groups)


@pytest.mark.slow
def test_a_failure_reading_the_async_output_keeps_the_step_it_belongs_to(recorder_behaviour):
    """Under async scheduling a device fault of a step (a device-side assert) surfaces only where
    the engine reads the step's output, after `sample_tokens` returned and maybe after the next
    step started: the recorder armed on exceptions keeps that step with the error (on an H200,
    vLLM 0.26's V1 with async scheduling lost such a step before this)."""
    outcome = recorder_behaviour["output_fault"]
    if outcome is None:
        pytest.skip("V1 on CPU returns its output at once (async scheduling does not take effect here): "
                    "no read to fail; tests/gpu/test_gpu_always_on.py runs a real one under V1-async")
    injected = recorder_behaviour["output_fault_error"]
    assert outcome["raised"] == injected and not outcome["failures"], outcome
    (path,) = outcome["written"]
    _, step = load_step(path, None)
    assert step.trigger == "exception" and step.error["message"] == injected
    assert step.error["phase"] == "output", step.error
    assert step.requests and step.kv.groups[0].before  # the KV it read, as for a failure inside the step


@pytest.mark.slow
def test_replaying_the_failing_step_without_the_injected_fault_does_not_reproduce(recorder_behaviour, eager_replays):
    """The fault was injected into the recording process only: the replayed forward does not
    raise, so the recorded failure is NOT reproduced and the report names the item "error"."""
    (path,) = recorder_behaviour["exception_written"]
    result = eager_replays["replays"][path]
    assert result["reproduced"] is False and result["first_divergence"] == "error"
    (check,) = result["checks"]
    assert check["raised"] is None and "did not raise" in check["problem"]


@pytest.mark.slow
def test_nonfinite_trigger_fires_on_the_step_whose_output_got_a_nan(recorder_behaviour):
    assert not recorder_behaviour["nonfinite_failures"]
    (path,) = recorder_behaviour["nonfinite_written"]  # only the poisoned step, none of the others
    _, step = load_step(path, None)
    assert step.index == recorder_behaviour["inject_at_call"] - 1 and step.trigger == "nonfinite"
    assert step.outputs.finite is False
    assert torch.isnan(step.outputs.hidden_states[0, 0]) and torch.isfinite(step.outputs.hidden_states[1:]).all()


# The `tracekit` script's CLI, which then writes whether vLLM was ever imported: every refusal comes
# before vLLM is, so before any engine could start (a bound on the seconds taken depends on load).
CLI_THEN_SAY_IF_VLLM_IMPORTED = (
    "import atexit, os, sys\n"
    "atexit.register(lambda: open(os.environ['VLLM_IMPORTED_TO'], 'w').write(str('vllm' in sys.modules)))\n"
    "from tracekit.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize(
    "arguments, complaint",
    [
        (["--when", "num_reqs>>2"], "bad --when"),
        (["--when", "foo==1"], "unknown name 'foo'"),
        (["--steps", "9:3"], "empty range"),
        (["-o", "/nonexistent/x.zst"], "does not exist"),
        # tests run as root, for whom chmod 0500 does not stop writes; /sys refuses even root
        (["-o", "/sys/x.zst"], "Permission denied"),
    ],
    ids=["when-bad-operator", "when-unknown-name", "steps-empty-range", "output-missing-dir", "output-read-only-dir"],
)
def test_bad_record_arguments_exit_2_with_one_line_before_any_engine_starts(arguments, complaint, tmp_path,
                                                                            tmp_path_factory, monkeypatch):
    said = tmp_path_factory.mktemp("said") / "vllm-imported"
    monkeypatch.setenv("VLLM_IMPORTED_TO", str(said))
    finished = run([sys.executable, "-c", CLI_THEN_SAY_IF_VLLM_IMPORTED, "record", "--enforce-eager", *arguments],
                   cwd=tmp_path)
    assert finished.returncode == 2, finished.explain()
    lines = error_lines(finished.stderr)
    assert len(lines) == 1 and lines[0].startswith("tracekit: error:") and complaint in lines[0], finished.explain()
    assert "Traceback" not in finished.stdout + finished.stderr
    assert list(tmp_path.iterdir()) == []  # no default bundle either
    assert said.read_text() == "False", "vLLM was imported: an engine could have started"
