"""Issue 31, without an engine: which steps this tracekit cannot replay in kind, said before
anything is built (`step_features`), and the LoRA adapter files a bundle may write back.

The step is the real mixed step of traces/ (four decodes, one prefill chunk), edited as a newer
recorder, an older one, or a stranger could have written it."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tracekit.errors import BundleError, CannotRunHere, NotReplayableYet
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, GrammarRecord, LoRAAdapter, NewRequestRecord
from tracekit.integrations.vllm.records.step_features import FEATURES, not_replayable_reason, step_features
from tracekit.integrations.vllm.replay_engine import require_replayable_kind
from tracekit.integrations.vllm.runners.lora_adapters import locate

SAMPLE = Path(__file__).parents[2] / "traces" / "tiny-llama-mixed-step.zst"


@pytest.fixture
def step():
    with open_bundle(SAMPLE) as reader:
        return BundleContent.from_plain(reader.metadata).steps[0]


def test_a_plain_step_old_or_new_replays(step):
    assert step.features is None and not_replayable_reason(step) is None
    assert not_replayable_reason(dataclasses.replace(step, features={})) is None


def test_what_cannot_be_replayed_yet_is_named_with_its_requests(step):
    decode = step.batch_order[0]
    step.features = {"multimodal": [decode], "lora": [], "from_a_newer_tracekit": [decode]}
    with pytest.raises(NotReplayableYet) as refused:
        require_replayable_kind(step)
    assert refused.value.exit_code == 5
    message = str(refused.value)
    assert f"multimodal inputs (requests {decode})" in message and "can be recorded but not yet replayed" in message
    assert f"'from_a_newer_tracekit' (a kind this tracekit does not know; requests {decode})" in message


def test_an_older_bundle_is_judged_by_what_it_holds(step):
    """Before `Step.features`: the step's new requests (multimodal, prompt embeds), drafts (which
    replay), and a grammar request that samples without a recorded mask."""
    output = step.scheduler_output
    output.scheduled_new_reqs = [NewRequestRecord(step.batch_order[4], mm_features=[{"modality": "image"}])]
    assert "multimodal inputs" in not_replayable_reason(step)
    output.scheduled_new_reqs, output.scheduled_spec_decode_tokens = [], {step.batch_order[0]: [5, 6]}
    assert not_replayable_reason(step) is None  # drafts replay (their tokens are in the scheduler output)
    output.scheduled_spec_decode_tokens = {}
    sampling = step.requests[0]
    sampling.sampling_params = dataclasses.replace(sampling.sampling_params, structured_outputs={"regex": "[0-9]+"})
    assert "lacks the grammar mask its structured-output requests sampled under" in not_replayable_reason(step)
    step.grammar = GrammarRecord([sampling.req_id], [1], torch.zeros(1, 16, dtype=torch.int32))
    assert not_replayable_reason(step) is None
    # a prefill chunk that samples nothing needs no mask
    chunk = step.requests[4]
    chunk.sampling_params = dataclasses.replace(chunk.sampling_params, structured_outputs={"regex": "[0-9]+"})
    assert not chunk.samples and not_replayable_reason(step) is None


def test_a_lora_request_needs_its_adapter_in_the_bundle(step):
    step.features = {"lora": [step.batch_order[1]]}
    step.requests[1].lora_adapter = "a"
    assert "the LoRA adapter of request(s) " + step.batch_order[1] in not_replayable_reason(step)
    step.lora_adapters = [LoRAAdapter(name="a", int_id=1, slot=0)]
    assert not_replayable_reason(step) is None


def test_the_recorder_reads_features_off_vllm_request_objects():
    """vLLM's own request records (the `NewRequestData` a scheduler output brings; V1's
    `CachedRequestState` has the same fields)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    def request(req_id, **fields):
        return req_id, NewRequestData(**{
            "req_id": req_id, "prompt_token_ids": [1, 2], "mm_features": [], "sampling_params": SamplingParams(),
            "pooling_params": None, "block_ids": ([0],), "num_computed_tokens": 0, "lora_request": None, **fields})

    image = MultiModalFeatureSpec(data=None, modality="image", identifier="x", mm_position=PlaceholderRange(0, 1))
    requests = [
        request("g", sampling_params=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))),
        request("l", lora_request=LoRARequest("a", 1, "/a")),
        request("e", prompt_token_ids=None, prompt_embeds=torch.zeros(2, 4)),
        request("m", mm_features=[image]),
        request("p"),
        ("unknown", None),  # V2 keeps no object for a request it saw start before the recorder was armed
    ]
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.scheduled_spec_decode_tokens = {"p": [3]}
    assert step_features(requests, scheduler_output) == {
        "structured_outputs": ["g"], "lora": ["l"], "prompt_embeds": ["e"], "multimodal": ["m"],
        "speculative_decoding": ["p"],
    }
    assert set(step_features(requests, scheduler_output)) <= set(FEATURES)


def test_a_kept_adapter_file_must_be_bytes(step):
    """(Its name was checked when the bundle was read: tests/record/test_schema.py.)"""
    step.lora_adapters = [LoRAAdapter(name="a", int_id=1, slot=0, files={"adapter_config.json": torch.zeros(2, 3)})]
    with pytest.raises(BundleError, match="'adapter_config.json' should be uint8 bytes"):
        locate(step, {}, allow_mismatch=False)


def test_a_kept_adapter_is_written_to_a_folder_of_the_replays_and_removed_after(step, tmp_path):
    files = {"adapter_config.json": torch.frombuffer(bytearray(b'{"r": 8}'), dtype=torch.uint8),
             "adapter_model.safetensors": torch.zeros(5, dtype=torch.uint8)}
    source = tmp_path / "source"
    source.mkdir()
    for name, data in files.items():
        (source / name).write_bytes(data.numpy().tobytes())
    from tracekit.integrations.vllm.records.weights import adapter_fingerprint

    step.lora_adapters = [LoRAAdapter(name="a", int_id=3, slot=0, fingerprint=adapter_fingerprint(source), files=files)]
    with locate(step, {}, allow_mismatch=False) as located:
        folder = Path(located.paths[3])
        assert sorted(path.name for path in folder.iterdir()) == sorted(files)
        assert adapter_fingerprint(folder) == adapter_fingerprint(source)
    assert not folder.exists()
    step.lora_adapters[0].fingerprint = "blake2b-128:" + "0" * 32
    with pytest.raises(CannotRunHere, match="differs from the recorded one"):
        locate(step, {}, allow_mismatch=False)
    with locate(step, {}, allow_mismatch=True) as located:
        assert located.paths
