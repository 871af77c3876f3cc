"""The bundle content schema reads what newer tracekits wrote (extra fields kept) and refuses
malformed content from a stranger with the place it is wrong."""

import pytest

from tracekit.errors import BundleError
from tracekit.format.schema import SCHEMA_VERSION, BundleContent, Environment, RequestState


def _content_plain() -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "created_at": "2026-12-02T00:00:00+00:00",
        "environment": {"tracekit_version": "0.1.0", "from_the_future": {"x": 1}},
        "engine": {
            "vllm_version": "0.32.0",
            "engine_args": {"model": "/m"},
            "model": {"path": "/m", "weights_fingerprint": "blake2b-128:00"},
            "num_kv_blocks": 16,
            "block_size": 32,
        },
        "steps": [],
        "added_in_v2": [1, 2, 3],
    }


def test_unknown_fields_are_kept_and_written_back():
    content = BundleContent.from_plain(_content_plain())
    assert content.extras == {"added_in_v2": [1, 2, 3]}
    assert content.environment.extras == {"from_the_future": {"x": 1}}
    again = content.to_plain()
    assert again["added_in_v2"] == [1, 2, 3]
    assert again["environment"]["from_the_future"] == {"x": 1}


def test_missing_optional_fields_take_defaults():
    environment = Environment.from_plain({"tracekit_version": "0.0.9"})
    assert environment.device_kind == "cpu" and environment.env_vars == {}


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda c: c.update(steps={"not": "a list"}), "bundle.steps should be a list"),
        (lambda c: c.update(engine=[1]), "bundle.engine should be a map"),
        (lambda c: c["engine"].pop("model"), "EngineConfig|bundle.engine lacks required field"),
        (lambda c: c.update(steps=[7]), r"bundle.steps\[0\] should be a map"),
        (lambda c: c.update(schema_version="1"), "bundle.schema_version should be an int, not a str"),
        (lambda c: c.update(schema_version=0), "bundle.schema_version should be from 1 to"),
    ],
)
def test_malformed_content_is_refused_with_its_place(mutate, where):
    plain = _content_plain()
    mutate(plain)
    with pytest.raises(BundleError, match=where):
        BundleContent.from_plain(plain)


def test_prefill_is_derived_from_computed_prompt_and_output_tokens():
    # A new request prefills through its last prompt token, however the prompt is chunked.
    request = RequestState("r", [1, 2, 3], [], [[0]], num_computed_tokens=2, num_scheduled_tokens=1)
    assert request.is_prefill
    # After 2 outputs a decode computes the newest one: computed = 3 prompt + 2 outputs - 1.
    request.output_token_ids = [7, 8]
    request.num_computed_tokens = 4
    assert not request.is_prefill


@pytest.mark.parametrize("computed", [0, 2, 3])
def test_a_request_recomputing_past_its_prompt_after_preemption_is_a_prefill(computed):
    # Resumed with 2 outputs: it recomputes tokens 0..3 (prompt and the first output) before
    # its next decode computes the newest token (index 4).
    request = RequestState("r", [1, 2, 3], [7, 8], [[0]], num_computed_tokens=computed, num_scheduled_tokens=1)
    assert request.is_prefill


def _step_plain(**fields) -> dict:
    """A step record's plain form with only what the schema requires, and `fields` on top."""
    return {
        "index": 0, "trigger": "steps 0", "scheduler_output": {}, "batch_order": ["r"],
        "requests": [{"req_id": "r", "prompt_token_ids": [1], "output_token_ids": [], "block_ids": [[0]],
                      "num_computed_tokens": 0, "num_scheduled_tokens": 1}],
        "input_ids": None, "positions": None, "kv": {"mode": "read"},
        "graph": {"compilation_mode": "NONE", "cudagraph_mode": "NONE"}, **fields,
    }


def test_grammar_lora_and_features_round_trip():
    from tracekit.format.schema import Step

    plain = _step_plain(
        grammar={"request_ids": ["r"], "rows_per_request": [3], "bitmask": {"$tensor": "m"},
                 "num_acceptable_drafts": [2]},
        lora_adapters=[{"name": "a", "int_id": 1, "slot": 1, "rank": 8, "target_modules": ["q_proj"],
                        "fingerprint": "blake2b-128:00", "files": {}}],
        features={"structured_outputs": ["r"], "lora": ["r"]},
    )
    plain["requests"][0]["lora_adapter"] = "a"
    step = Step.from_plain(plain)
    assert step.grammar.rows_of("r") == range(0, 3) and step.grammar.rows_of("other") == range(0)
    assert (step.lora_adapters[0].slot, step.requests[0].lora_adapter) == (1, "a")
    assert Step.from_plain(step.to_plain()).to_plain() == step.to_plain()
    # a bundle from before these fields: none of them
    old = Step.from_plain(_step_plain())
    assert (old.grammar, old.lora_adapters, old.features, old.requests[0].lora_adapter) == (None, [], None, None)


MASK = {"$tensor": "m"}


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"grammar": {"request_ids": "r", "rows_per_request": [1], "bitmask": MASK}}, "grammar.request_ids should be a list"),
        ({"grammar": {"request_ids": ["r"], "rows_per_request": [0], "bitmask": MASK}},
         r"grammar.rows_per_request\[0\] should be from 1"),
        ({"grammar": {"request_ids": ["r"], "rows_per_request": [1], "bitmask": MASK, "num_acceptable_drafts": [1, 2]}},
         r"should hold rows_per_request \(and num_acceptable_drafts\) for each of its request_ids"),
        ({"features": {"lora": "r"}}, r"features\['lora'\] should be a list"),
        ({"lora_adapters": [{"name": "a"}]}, "lacks required field"),
        ({"lora_adapters": [{"name": "a", "int_id": 0, "slot": 0}]}, r"lora_adapters\[0\].int_id should be from 1"),
        ({"lora_adapters": [{"name": "a", "int_id": 1, "slot": 0, "files": {"../x.safetensors": MASK}}]},
         "only adapter_config.json and \\*.safetensors files are kept"),
    ],
)
def test_malformed_grammar_lora_or_features_are_refused(fields, problem):
    from tracekit.format.schema import Step

    with pytest.raises(BundleError, match=problem):
        Step.from_plain(_step_plain(**fields))
