"""The deterministic modes a recording engine ran in are the replay engine's too, and a step that
parts in float items only gets a note naming the kernels that did not run as recorded: Inductor's
kernels with another autotuned configuration (Inductor's per-process autotuning: measured on the
H200, tests/gpu), the engine's other Triton kernels with another binary (another ptxas release:
measured on the H100) — or saying that every kernel did."""

import os
import sys
from types import SimpleNamespace

import pytest

from tracekit.format.schema import KernelChoice
from tracekit.integrations.vllm.engines.build import DETERMINISM_VARIABLES, apply_recorded_determinism
from tracekit.replay.checks import CheckedItem
from tracekit.replay.replayer import _kernel_notes


@pytest.fixture
def clean_env(monkeypatch):
    for name in DETERMINISM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "deterministic", False)
    return inductor_config


def test_recorded_deterministic_modes_are_set_and_this_process_wins(clean_env, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # set here: kept
    recorded = {"TORCHINDUCTOR_DETERMINISTIC": "1", "VLLM_BATCH_INVARIANT": "1", "VLLM_OTHER": "x"}
    applied = apply_recorded_determinism(recorded)
    assert applied == ["TORCHINDUCTOR_DETERMINISTIC=1"]
    assert os.environ["TORCHINDUCTOR_DETERMINISTIC"] == "1" and os.environ["VLLM_BATCH_INVARIANT"] == "0"
    assert "VLLM_OTHER" not in os.environ
    # Inductor read its variables when it was imported: its config is set too.
    assert sys.modules["torch._inductor.config"].deterministic is True
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC")
    assert apply_recorded_determinism({}) == []


CHOICE = KernelChoice("triton_red_fused_0", "ab" * 32, {"XBLOCK": 8, "num_warps": 4, "num_stages": 1})


def _content(*choices):
    return SimpleNamespace(engine=SimpleNamespace(kernel_choices=list(choices)))


FLOAT_PARTED = [CheckedItem("input_ids", True, True, {}), CheckedItem("logits", False, False, {}, "float32")]
OTHER = "triton_red_fused_0: XBLOCK=16,num_warps=4,num_stages=1 here, XBLOCK=8,num_warps=4,num_stages=1 recorded"


def test_a_kernel_that_ran_otherwise_is_named_with_both_configurations():
    (note,) = _kernel_notes(_content(CHOICE), "compiled", FLOAT_PARTED,
                            {"same": [], "other": [OTHER], "unrecorded": []})
    assert OTHER in note


def test_kernels_autotuned_without_a_recorded_choice_are_named():
    (note,) = _kernel_notes(_content(), "compiled", FLOAT_PARTED,
                            {"same": [], "other": [], "unrecorded": ["triton_per_fused_1"]})
    assert "no choice recorded: triton_per_fused_1" in note


def test_kernels_that_all_ran_as_recorded_are_ruled_out():
    (note,) = _kernel_notes(_content(CHOICE), "compiled", FLOAT_PARTED,
                            {"same": ["triton_red_fused_0"], "other": [], "unrecorded": []})
    assert "every one of the 1 autotuned kernels ran with its recorded configuration" in note


SEVERAL = ("triton_per_fused_add_rms_norm_0: XBLOCK=1,num_warps=2,num_stages=1 here, "
           "XBLOCK=1,num_warps=2,num_stages=1 and XBLOCK=32,num_warps=2,num_stages=1 recorded")


def test_a_kernel_whose_copies_ran_with_several_configurations_is_named_with_all_of_them():
    """A process whose kernels came back from Inductor's compile workers ran copies of one source
    otherwise (issue 28, H100): where the copies cannot be told apart by their graphs, that is
    named rather than every kernel said to have run as recorded."""
    (note,) = _kernel_notes(_content(CHOICE), "compiled", FLOAT_PARTED,
                            {"same": ["triton_red_fused_0"], "other": [], "unrecorded": [], "several": [SEVERAL]})
    assert SEVERAL in note and "rounding difference lies elsewhere" not in note


UNAPPLIED = "triton_per_fused_add_rms_norm_0 in graph 0123456789ab: XBLOCK=32,num_warps=2,num_stages=1 not given (KeyError: x)"


def test_a_copy_the_replay_could_not_give_its_configuration_is_named_with_why():
    (note,) = _kernel_notes(_content(CHOICE), "compiled", FLOAT_PARTED,
                            {"same": ["triton_red_fused_0"], "other": [], "unrecorded": [], "several": [],
                             "unapplied": [UNAPPLIED]})
    assert UNAPPLIED in note and "rounding difference lies elsewhere" not in note


NAMED = {"same": [], "other": [OTHER], "unrecorded": []}


@pytest.mark.parametrize("mode, checks, kernels", [
    ("eager", FLOAT_PARTED, NAMED),  # no Inductor
    ("compiled", [CheckedItem("sampled_token_ids", False, False, {}), *FLOAT_PARTED], NAMED),  # ids parted
    ("compiled", [CheckedItem("logits", False, False, {}, "float32", decides=False)], NAMED),  # padding only
    ("compiled", FLOAT_PARTED, {"same": [], "other": [], "unrecorded": []}),  # no kernels, none recorded (CPU)
])
def test_no_note_where_kernel_choices_do_not_explain_it(mode, checks, kernels):
    assert _kernel_notes(_content(), mode, checks, kernels) == []


def test_an_engine_for_kernel_choices_reads_its_compile_cache_switch_past_vllms_env_cache():
    """vLLM caches its variables once an engine has started (`enable_envs_cache`): the switch
    that keeps a replay with kernel choices off the compile cache must still count for the next
    engine of the process."""
    import vllm.envs as envs

    from tracekit.integrations.vllm.engines.lean_build import COMPILE_HERE_ENV, _set_engine_env

    saved = os.environ.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    envs.enable_envs_cache()  # as a first engine's start leaves it
    try:
        assert envs.VLLM_DISABLE_COMPILE_CACHE is False
        assert _set_engine_env({}, compile_here=False) == {}
        assert _set_engine_env({}, compile_here=True) == COMPILE_HERE_ENV
        assert envs.VLLM_DISABLE_COMPILE_CACHE is True
    finally:
        envs.disable_envs_cache()
        os.environ.pop("VLLM_DISABLE_COMPILE_CACHE", None)
        if saved is not None:
            os.environ["VLLM_DISABLE_COMPILE_CACHE"] = saved
