"""Unseeded sampling alone: a batch of unseeded top-k requests, no greedy or seeded request beside
them. V1 draws them with the device's global generator; V2 with a seed vLLM drew for each
request, except that vLLM 0.34 with FlashInfer installed samples such a batch with FlashInfer's
top-k kernel, whose Philox seed and offset come from the global generator (the GPU kits have no
FlashInfer and set VLLM_USE_FLASHINFER_SAMPLER=0: that path has not run here). Every step must
replay bit-exact with the noise deciding its draws, and other noise (every source:
`negative_controls.change_noise`) must be caught."""

import json

import pytest
from gpu_support import bundles_by_step, json_records, record_steps, tracekit
from negative_controls import Controls, add_noise_controls, assert_noise_caught

from tracekit.format.content import load_step

# Flat enough (temperature 1.5 over the 64 likeliest of the tiny model's 512 tokens) that the
# draws are rarely the argmax.
PROMPTS = ["The weather today", "A list of colours:", "Once upon a time", "Numbers: 4, 8,"]


@pytest.fixture(scope="module", params=["v2", "v1"])
def unseeded(request, tmp_path_factory):
    runner = request.param
    work = tmp_path_factory.mktemp(f"unseeded-{runner}")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "temperature": 1.5, "top_k": 64}) + "\n" for text in PROMPTS))
    steps = record_steps(work, prompts, "0:60", 10, ["--dtype", "bfloat16"], runner)
    (work / "controls").mkdir()
    controls = Controls()
    add_noise_controls(controls, bundles_by_step(steps), work / "controls")
    replay = tracekit("replay", steps, *controls.paths.values(), "--keep-going", "--no-timing", "--json",
                      work / "replays.jsonl", runner=runner)
    records = json_records(work / "replays.jsonl") if (work / "replays.jsonl").exists() else {}
    return bundles_by_step(steps), controls, records, replay


def test_every_step_replays_bit_exact_with_its_draws_decided_by_noise(unseeded):
    bundles, _, records, replay = unseeded
    off_argmax = 0
    for path in bundles.values():
        record = records.get(str(path))
        assert record is not None and record["verdict"] == "bit_exact", (path.name, record, replay.explain())
        _, step = load_step(path, None)
        for row, drawn in enumerate(step.outputs.sampled_token_ids or []):
            off_argmax += bool(drawn) and drawn[0] != int(step.outputs.logits[row].argmax())
    assert off_argmax, "every draw was the argmax: the noise decided nothing"


def test_other_noise_is_caught(unseeded):
    _, controls, records, replay = unseeded
    assert_noise_caught(controls, records)
    assert "Traceback" not in replay.stderr, replay.stderr[-3000:]
