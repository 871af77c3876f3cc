"""Where a replay's watermark key comes from (no engine: the arguments it would build one with).
The end-to-end test, tests/e2e/test_watermark.py, replays a watermarked step with each."""

import pytest

from tracekit.errors import CannotRunHere, UsageError
from tracekit.format.schema import EngineConfig, ModelInfo
from tracekit.integrations.vllm.replay_engine import replay_engine_args

RECORDED = {"algorithm": "gumbel", "context_width": 4}
ENGINE = EngineConfig(vllm_version="0.32.0", engine_args={"model": "/m", "watermark_config": RECORDED},
                      model=ModelInfo(path="/m"), num_kv_blocks=8, block_size=32)


def test_the_key_comes_from_the_environment_and_is_refused_without_it(monkeypatch):
    monkeypatch.delenv("TRACEKIT_WATERMARK_KEY", raising=False)
    with pytest.raises(CannotRunHere, match="set TRACEKIT_WATERMARK_KEY"):
        replay_engine_args(ENGINE, None, False, {})
    monkeypatch.setenv("TRACEKIT_WATERMARK_KEY", "0x2a")
    assert replay_engine_args(ENGINE, None, False, {})["watermark_config"] == {**RECORDED, "key": 42}
    monkeypatch.setenv("TRACEKIT_WATERMARK_KEY", "forty-two")
    with pytest.raises(UsageError, match="TRACEKIT_WATERMARK_KEY is not an integer"):
        replay_engine_args(ENGINE, None, False, {})


def test_a_watermark_config_given_as_an_engine_argument_is_the_one_replayed(monkeypatch):
    monkeypatch.delenv("TRACEKIT_WATERMARK_KEY", raising=False)
    given = {**RECORDED, "key": 7}
    assert replay_engine_args(ENGINE, None, False, {"watermark_config": given})["watermark_config"] == given
