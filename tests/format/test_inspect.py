import json

import pytest
import torch
from click.testing import CliRunner

import tracekit.format.reader
from tracekit.cli import main
from tracekit.format import FORMAT_VERSION, BundleWriter


@pytest.fixture
def step_bundle(tmp_path):
    """A bundle whose metadata follows the content schema: one step, a prefill and a decode."""
    path = tmp_path / "step.zst"
    with BundleWriter(path) as writer:
        ids = writer.add_tensor("steps/0/input_ids", torch.arange(9))
        request = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_token_ids": [], "block_ids": [[0]]}
        writer.set_metadata({
            "environment": {"tracekit_version": "0.1.0", "vllm_version": "0.32.0", "torch_version": "2.13.0",
                            "device_kind": "cpu", "device_name": "test-cpu", "platform": "Linux"},
            "engine": {"vllm_version": "0.32.0", "engine_args": {}, "model": {"path": "tiny-llama", "architecture": "LlamaForCausalLM"},
                       "num_kv_blocks": 8, "block_size": 16},
            "steps": [{
                "index": 3, "trigger": "mixed", "scheduler_output": {}, "batch_order": ["a", "b"],
                "requests": [
                    dict(request, req_id="a", num_computed_tokens=0, num_scheduled_tokens=8),
                    dict(request, req_id="b", output_token_ids=[9], num_computed_tokens=8, num_scheduled_tokens=1),
                ],
                "input_ids": ids, "positions": ids, "kv": {"mode": "read"},
                "graph": {"compilation_mode": "NONE", "cudagraph_mode": "NONE"},
            }],
        })
    return path


def test_inspect_json_reads_only_metadata_and_index(step_bundle, monkeypatch):
    def no_tensor_reads(*args, **kwargs):
        raise AssertionError("inspect decoded a tensor")

    monkeypatch.setattr(tracekit.format.reader, "decode_chunk", no_tensor_reads)
    result = CliRunner().invoke(main, ["inspect", str(step_bundle), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["format_version"] == FORMAT_VERSION and summary["model"]["path"] == "tiny-llama"
    assert summary["environment"]["vllm_version"] == "0.32.0"
    assert summary["steps"][0]["requests"] == [
        {"req_id": "a", "num_scheduled_tokens": 8, "num_computed_tokens": 0, "num_prompt_tokens": 8,
         "num_output_tokens": 0, "num_draft_tokens": 0, "phase": "prefill"},
        {"req_id": "b", "num_scheduled_tokens": 1, "num_computed_tokens": 8, "num_prompt_tokens": 8,
         "num_output_tokens": 1, "num_draft_tokens": 0, "phase": "decode"},
    ]
    assert summary["steps"][0]["dispatch"]["runtime_mode"] == "NONE"
    assert summary["steps"][0]["kv"]["mode"] in ("read", "written", "none")
    assert summary["tensors"][0] | {"stored_nbytes": 0} == {
        "name": "steps/0/input_ids", "dtype": "int64", "shape": [9], "nbytes": 72, "stored_nbytes": 0,
        "filter": "none", "codec": "zstd",
    }


def test_inspect_table_and_verify(step_bundle):
    result = CliRunner().invoke(main, ["inspect", str(step_bundle), "--verify"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for expected in (f"format {FORMAT_VERSION}", "vLLM 0.32.0", "tiny-llama", "step 3 (trigger: mixed)", "prefill", "decode",
                     "steps/0/input_ids", "int64", "verify: all 5 parts intact"):
        assert expected in result.output, expected


def test_inspect_of_a_bundle_without_the_step_schema(small_bundle):
    result = CliRunner().invoke(main, ["inspect", str(small_bundle), "--json", "--verify"])
    summary = json.loads(result.output)
    assert summary["content"].startswith("not a recorded engine step")
    assert summary["verify"] == {"ok": True, "parts_checked": 7, "damaged": {}}


def test_inspect_full_shows_a_map_that_only_looks_like_a_tensor_reference_as_data(step_bundle, tmp_path):
    """Issue 18: `{"$tensor": [...]}` (no string name, so no reference: the reader lets it through)
    made `inspect --json --full` raise TypeError; only a reference is summarized as a tensor."""
    from tracekit.format.rewrite import rewrite_bundle

    def add_lookalikes(metadata, tensors):
        metadata["lookalikes"] = {"list": {"$tensor": [1, 2]}, "map": {"$tensor": {"a": 1}}, "int": {"$tensor": 5}}

    path = rewrite_bundle(step_bundle, tmp_path / "odd.zst", add_lookalikes)
    result = CliRunner().invoke(main, ["inspect", str(path), "--json", "--full"])
    assert result.exit_code == 0, (result.output, result.exception)
    content = json.loads(result.output)["content"]
    assert content["lookalikes"] == {"list": {"$tensor": [1, 2]}, "map": {"$tensor": {"a": 1}}, "int": {"$tensor": 5}}
    assert content["steps"][0]["input_ids"] == {"tensor": "steps/0/input_ids", "dtype": "int64", "shape": [9]}
