"""The deterministic modes a recording engine ran in are the replay engine's too, and a compiled
GPU step that parts in float items only, recorded without Inductor's deterministic mode, gets a
note saying why (Inductor's per-process autotuning: measured on the H200, tests/gpu)."""

import os
import sys
from types import SimpleNamespace

import pytest

from tracekit.integrations.vllm.engine import DETERMINISM_VARIABLES, apply_recorded_determinism
from tracekit.replay.checks import CheckedItem
from tracekit.replay.replayer import _autotuning_notes


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


def _content(device_kind="cuda", **env):
    return SimpleNamespace(environment=SimpleNamespace(device_kind=device_kind, env_vars=env))


FLOAT_PARTED = [CheckedItem("input_ids", True, True, {}), CheckedItem("logits", False, False, {}, "float32")]


def test_a_compiled_gpu_step_parting_in_floats_only_says_why():
    (note,) = _autotuning_notes(_content(), "compiled", FLOAT_PARTED)
    assert "TORCHINDUCTOR_DETERMINISTIC=1" in note


@pytest.mark.parametrize("content, mode, checks", [
    (_content(TORCHINDUCTOR_DETERMINISTIC="1"), "compiled", FLOAT_PARTED),  # recorded deterministic
    (_content(), "eager", FLOAT_PARTED),  # no Inductor
    (_content("cpu"), "compiled", FLOAT_PARTED),  # Inductor's CPU code is not autotuned by timing
    (_content(), "compiled", [CheckedItem("sampled_token_ids", False, False, {}), *FLOAT_PARTED]),  # ids parted
    (_content(), "compiled", [CheckedItem("logits", False, False, {}, "float32", decides=False)]),  # padding only
])
def test_no_note_where_autotuning_does_not_explain_it(content, mode, checks):
    assert _autotuning_notes(content, mode, checks) == []
