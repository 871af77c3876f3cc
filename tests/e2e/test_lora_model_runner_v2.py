"""Issue 31: LoRA steps of Model Runner V2 (through the CPU harness) replay bit-exact, every
adapter back in its slot. (V2's grammar mask kernel does not run in Triton's interpreter: its
structured-output steps are covered on the GPU, `tests/gpu`.)"""

import pytest
from e2e_support import assert_replayed_bit_exact, engine_script, read_step
from features_support import make_adapter, record_features

pytestmark = pytest.mark.slow


def test_lora_steps_of_model_runner_v2_replay_bit_exact(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora-v2")
    a, b = make_adapter(work / "adapter-a", seed=1), make_adapter(work / "adapter-b", seed=2)
    _, recorded = record_features(work, "grammar_lora", a, b, runner="v2")
    assert all(read_step(path).grammar is None for path in recorded.values())
    assert any({"a", "b", None} <= {r.lora_adapter for r in read_step(path).requests} for path in recorded.values())
    replays = engine_script("replay_many", work / "replays.json", *recorded.values(), runner="v2")
    assert_replayed_bit_exact(replays, recorded)
