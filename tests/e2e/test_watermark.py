"""A step recorded with vLLM's watermark on (Model Runner V2, through the CPU harness; the watermark
needs V2): the bundle holds the watermark's settings but never its key. The replay asks for the key
(`TRACEKIT_WATERMARK_KEY`; exit 3 without it, before any engine starts) and is bit-exact with it,
while another key samples the watermarked requests otherwise (so the key given is the key used)."""

import json

import pytest
from e2e_support import read_content, tracekit

from tracekit.format.reader import BundleReader

pytestmark = pytest.mark.slow
KEY = 20261207


def test_a_watermarked_step_keeps_its_key_out_and_replays_with_the_key_given(tmp_path, monkeypatch):
    bundle = tmp_path / "watermarked.zst"
    recorded = tracekit("record", "-o", bundle, "--watermark-config", json.dumps({"key": KEY}), runner="v2")
    assert recorded.returncode == 0, recorded.explain()
    config = read_content(bundle).engine.engine_args["watermark_config"]
    assert config["algorithm"] == "gumbel" and "key" not in config
    with BundleReader(bundle) as reader:
        assert str(KEY) not in json.dumps(reader.metadata, default=str)

    monkeypatch.delenv("TRACEKIT_WATERMARK_KEY", raising=False)
    refused = tracekit("replay", bundle, runner="v2")
    assert refused.returncode == 3 and "set TRACEKIT_WATERMARK_KEY" in refused.stderr, refused.explain()

    monkeypatch.setenv("TRACEKIT_WATERMARK_KEY", str(KEY))
    replayed = tracekit("replay", "--strict", bundle, runner="v2")
    assert replayed.returncode == 0 and "bit_exact" in replayed.stdout, replayed.explain()

    monkeypatch.setenv("TRACEKIT_WATERMARK_KEY", str(KEY + 1))
    other_key = tracekit("replay", bundle, runner="v2")
    assert other_key.returncode == 1 and "sampled_token_ids" in other_key.stdout, other_key.explain()
