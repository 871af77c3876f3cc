"""What arming a recorder does to a live engine, all on one engine (in this order, since the
last part leaves the engine broken):

  outputs   the same greedy and seeded requests unarmed twice, then armed firing on every
            step, and armed recording windows of 3 steps tiling the run: the token ids must
            not change (the unarmed pair shows they are repeatable)
  write_failure
            armed, then the output folder is removed, and armed with one step's bundle path
            taken by a folder: the engine's outputs stay the same and no partial file remains
  nonfinite armed with on=("nonfinite",), one forward's output gets a NaN
  phase_faults
            one recorded step driven on the runner again, four times, each time with a recorder
            armed on=("exception",) and one phase broken (prepare, logits, sampling, bookkeeping)
  lost_context
            one recorded step driven on the runner again, twice, its sampling failing with a
            device-side assert as a poisoned CUDA context gives one: armed on=("exception",
            "nonfinite") with the non-finite check's device query meeting that error first, and
            armed steps="0:" + on=("exception",) with the wait for the step's copies meeting it
  output_fault
            one recorded step driven on the runner again, armed on=("exception",), reading its
            async output failing (Model Runner V2; V1 on CPU returns its output at once)
  exception armed with on=("exception",), one forward raises RuntimeError

    python recorder_behaviour.py RESULT.json WORK_DIR
"""

import shutil
import sys
from pathlib import Path

from engine_common import REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, eager_llm, generate_token_ids, patched, write_result

from tracekit.format.content import load_step
from tracekit.graphs.host_copy import DeviceFlag, HostCopy
from tracekit.integrations.vllm.engines.build import adapter_of, find_runner
from tracekit.record.api import recording

MAX_TOKENS = 8
INJECT_AT_CALL = 3  # the third forward after arming: engine step 2
INJECTED_ERROR = "injected failure in the model forward"


def generate(llm):
    llm.reset_prefix_cache()  # every run computes every prompt token: the same batches each time
    return generate_token_ids(llm, REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, MAX_TOKENS)


def inject_into_forward(model, on_call, change_output=None, error=None):
    """Shadow `model.forward` on the instance: on call number `on_call`, raise `error` or
    pass the output through `change_output`."""
    original, calls = model.forward, [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call and error is not None:
            raise error
        output = original(*args, **kwargs)
        return change_output(output) if calls[0] == on_call and change_output else output

    model.forward = forward
    return lambda: model.__dict__.pop("forward", None)


# Where each phase of a step is broken, per runner kind: a method the runner calls in that phase
# (inside bookkeeping, below the recorder's shadow of it). The forward's own failure is the
# `exception` case above.
PHASE_FAULTS = {
    "prepare": {"v1": lambda runner: (runner, "_prepare_inputs"), "v2": lambda runner: (runner, "prepare_inputs")},
    "logits": {"v1": lambda runner: (runner.model, "compute_logits"), "v2": lambda runner: (runner.model, "compute_logits")},
    "sampling": {"v1": lambda runner: (runner, "_sample"), "v2": lambda runner: (runner.sampler, "sample")},
    "bookkeeping": {"v1": lambda runner: (runner, "_get_prompt_logprobs_dict"),
                    "v2": lambda runner: (runner.model_state, "postprocess_state")},
}


def drive_broken_step(llm, step, target, name, fail, output, **triggers):
    """Drive the recorded `step` again on the live runner, with a recorder armed on `triggers`
    and `target.name` replaced by `fail` (over the recorder's own shadow, if it has one); the step
    is finished after, so the engine goes on. What the drive raised, and what the recorder wrote."""
    adapter = adapter_of(llm)
    runner = adapter.runner
    raised = None
    with recording(llm, output, **triggers) as recorder:
        shadow = target.__dict__.get(name)
        setattr(target, name, fail)
        try:
            runner.execute_model(adapter.scheduler_output_for(step))
            sampled = runner.sample_tokens(None)
            if hasattr(sampled, "get_output"):
                sampled.get_output()
        except RuntimeError as error:
            raised = str(error)
        finally:
            if shadow is not None and recorder.armed:
                setattr(target, name, shadow)
            else:  # (a recorder that gave up took its shadows off, which left ours)
                target.__dict__.pop(name, None)
            runner.execute_model_state = None
            runner.execute_model(adapter.release.finishing_output(list(step.batch_order)))
    return {"raised": raised, "written": [str(p) for p in recorder.written], "failures": recorder.failures}


def phase_faults(llm, bundle, out):
    """One recorded step driven again with a recorder armed `on=("exception",)`, once per phase,
    that phase broken; the engine survives them all."""
    adapter = adapter_of(llm)
    _, step = load_step(bundle, None)
    outcomes = {}
    for phase, where in PHASE_FAULTS.items():
        target, name = where[adapter.kind.value](adapter.runner)
        message = f"injected failure in {phase}"

        def fail(*args, message=message, **kwargs):
            raise RuntimeError(message)

        outcomes[phase] = drive_broken_step(llm, step, target, name, fail, f"{out}/{phase}{{step}}.zst",
                                            on=("exception",), max_bundles=4)
    return outcomes


LOST_CONTEXT = "CUDA error: device-side assert triggered"


def _lose_context(*args, **kwargs):
    raise RuntimeError(LOST_CONTEXT)


# What the recorder itself meets of a poisoned context, per arming: the non-finite check's query
# of its device flag (an event on a GPU), or the wait for the step's copies to host.
LOST_CONTEXT_ARMINGS = {
    "marked": ({"on": ("exception", "nonfinite")}, DeviceFlag, "ready"),
    "copied": ({"steps": "0:", "on": ("exception",), "max_bundles": 4}, HostCopy, "wait"),
}


def lost_context(llm, bundle, out):
    """One recorded step driven again, once per arming, its sampling failing as a lost device
    context makes it, after the recorder's own device call in the step met the error first: the
    recorder stays armed and keeps the step from host memory."""
    adapter = adapter_of(llm)
    _, step = load_step(bundle, None)
    target, name = PHASE_FAULTS["sampling"][adapter.kind.value](adapter.runner)
    outcomes = {}
    for arming, (triggers, poisoned, method) in LOST_CONTEXT_ARMINGS.items():
        with patched(poisoned, method, _lose_context):
            outcomes[arming] = drive_broken_step(llm, step, target, name, _lose_context, f"{out}/{arming}{{step}}.zst",
                                                 **triggers)
    return outcomes


OUTPUT_FAULT = "injected failure reading the step's output"


def output_fault(llm, bundle, out):
    """One recorded step driven again, reading its async output failing as a device fault of the
    step makes it under async scheduling (it surfaces where the engine waits for the sampled ids,
    after `sample_tokens` returned); None where the runner's output is no async one."""
    adapter = adapter_of(llm)
    if adapter.kind.value != "v2":
        return None
    import vllm.v1.worker.gpu.model_runner as v2_model_runner

    class FailingRead(v2_model_runner.AsyncOutput):
        def get_output(self):
            raise RuntimeError(OUTPUT_FAULT)

    _, step = load_step(bundle, None)
    # (the fault is the class the runner builds its output from; `patched` puts vLLM's back)
    with patched(v2_model_runner, "AsyncOutput", FailingRead):
        return drive_broken_step(llm, step, v2_model_runner, "AsyncOutput", FailingRead, f"{out}/output{{step}}.zst",
                                 on=("exception",), max_bundles=4)


def with_nan(hidden_states):
    hidden_states = hidden_states.clone()
    hidden_states[0, 0] = float("nan")
    return hidden_states


if __name__ == "__main__":
    work = Path(sys.argv[2])
    llm = eager_llm()
    runner = find_runner(llm)
    result = {"unarmed": [generate(llm), generate(llm)]}

    every_step = work / "every_step"
    every_step.mkdir()
    with recording(llm, f"{every_step}/step{{step}}.zst", steps="0:", max_bundles=1000) as recorder:
        result["armed"] = generate(llm)
    result["armed_steps_seen"] = recorder.steps_seen
    result["armed_written"] = [str(p) for p in recorder.written]

    windows = work / "windows"
    windows.mkdir()
    with recording(llm, f"{windows}/step{{step}}.zst", steps="0:", window=3, max_bundles=1000) as recorder:
        result["windowed"] = generate(llm)
    result["windowed_steps_seen"] = recorder.steps_seen
    result["windowed_written"] = [str(p) for p in recorder.written]
    result["windowed_failures"] = recorder.failures

    removed = work / "removed"
    removed.mkdir()
    with recording(llm, f"{removed}/step{{step}}.zst", steps="0:", max_bundles=1000) as recorder:
        shutil.rmtree(removed)
        result["removed_dir_outputs"] = generate(llm)
    result["removed_dir_failures"] = recorder.failures
    result["removed_dir_written"] = [str(p) for p in recorder.written]

    blocked = work / "blocked"
    blocked.mkdir()
    (blocked / "step1.zst").mkdir()  # step 1's bundle cannot be renamed into place
    with recording(llm, f"{blocked}/step{{step}}.zst", steps="0:3", max_bundles=1000) as recorder:
        result["blocked_path_outputs"] = generate(llm)
    result["blocked_path_failures"] = recorder.failures
    result["blocked_path_written"] = [str(p) for p in recorder.written]
    result["blocked_dir_listing"] = sorted(p.name for p in blocked.iterdir())

    nonfinite = work / "nonfinite"
    nonfinite.mkdir()
    with recording(llm, f"{nonfinite}/step{{step}}.zst", on=("nonfinite",)) as recorder:
        undo = inject_into_forward(runner.model, INJECT_AT_CALL, change_output=with_nan)
        try:
            generate(llm)
        finally:
            undo()
    result["nonfinite_written"] = [str(p) for p in recorder.written]
    result["nonfinite_failures"] = recorder.failures

    phases = work / "phases"
    phases.mkdir()
    result["phase_faults"] = phase_faults(llm, result["armed_written"][0], phases)

    lost = work / "lost_context"
    lost.mkdir()
    result["lost_context"] = lost_context(llm, result["armed_written"][0], lost)
    result["lost_context_error"] = LOST_CONTEXT

    output = work / "output_fault"
    output.mkdir()
    result["output_fault"] = output_fault(llm, result["armed_written"][0], output)
    result["output_fault_error"] = OUTPUT_FAULT

    exception = work / "exception"
    exception.mkdir()
    with recording(llm, f"{exception}/step{{step}}.zst", on=("exception",)) as recorder:
        inject_into_forward(runner.model, INJECT_AT_CALL, error=RuntimeError(INJECTED_ERROR))
        try:
            generate(llm)
            result["exception_raised"] = None
        except Exception as error:  # what the caller of generate sees
            result["exception_raised"] = f"{type(error).__name__}: {error}"
    result["exception_written"] = [str(p) for p in recorder.written]
    result["exception_failures"] = recorder.failures
    result["injected_error"] = INJECTED_ERROR
    result["inject_at_call"] = INJECT_AT_CALL
    write_result(result)
