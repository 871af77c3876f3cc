"""Speculative decoding on the GPU (vLLM 0.26): every step of a workload that drafts, recorded and
replayed bit-exact in a fresh process — drafts, the rejection sampler's acceptances, the
drafter's model calls and proposals checked — with a changed draft token named where it parts.

ngram on V1 (vLLM turns async scheduling off for it; 0.26's Model Runner V2 has no ngram), EAGLE
and EAGLE3 with the tiny draft configs shipped in tests/models (dummy weights beside the
embedded model's real ones) on V1 with async scheduling (vLLM's default) and without, MTP (the
embedded model as MiMo with one MTP layer, `tools/make_tiny_mtp.py`) on V1 and V2, and on V2
(async, FULL_AND_PIECEWISE graphs: its drafter may run as FULL graphs, with no model call to
check: its proposals are checked), and probabilistic drafting on both runners (the rejection
sampler reads the drafter's probabilities / logits). Greedy, penalised, seeded, unseeded and
top-k/top-p requests: on a GPU the rejection sampler's kernels are Triton's.
"""

import json
import random

import pytest
from gpu_support import (
    CAPTURE_SIZES,
    HAS_V1,
    MODELS,
    MTP,
    TINY_EAGLE,
    bundles_by_step,
    json_records,
    read_content,
    record_steps,
    speculative_args,
    tiny_mtp_target,
    tracekit,
)

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.gpu

GRAPHS = ["--compilation-config", json.dumps({"cudagraph_capture_sizes": CAPTURE_SIZES})]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def eagle(method: str = "eagle", draft: str = "tiny-eagle-llama", **extra) -> dict:
    """The tiny EAGLE drafting of `TINY_EAGLE`, of another method or draft config, or with more."""
    return {**TINY_EAGLE, "method": method, "model": str(MODELS / draft), **extra}


# name: (runner, speculative config, other engine arguments)
SPEC_CONFIGS = {
    "v1-ngram": ("v1", NGRAM, []),
    "v1-eagle-async": ("v1", eagle(), []),
    "v1-eagle-sync": ("v1", eagle(), ["--no-async-scheduling"]),
    "v2-eagle": ("v2", eagle(), []),
    "v1-eagle3": ("v1", eagle("eagle3", "tiny-eagle3-llama"), []),
    "v1-eagle-probabilistic": ("v1", eagle(draft_sample_method="probabilistic"), []),
    "v2-eagle-probabilistic": ("v2", eagle(draft_sample_method="probabilistic"), []),
    "v1-mtp": ("v1", MTP, []),
    "v2-mtp": ("v2", MTP, []),
}


STEPS, MAX_TOKENS = "0:40", 16


def _prompts(path):
    """Token ids over the whole vocabulary (the 40-token prompt's greedy continuation repeats, so
    ngram drafts are accepted), under every kind of sampling the GPU rejection sampler serves."""
    draw = random.Random(1)
    sampling = [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.2},
        {"temperature": 0.8, "seed": 5},
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3},
    ]
    lines = [{"prompt_token_ids": [draw.randrange(3, 512) for _ in range(length)], "ignore_eos": True, **params}
             for length, params in zip((8, 16, 24, 40, 12, 20), sampling)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _changed_draft(metadata, tensors):
    request = next(request for request in metadata["steps"][0]["requests"] if request["draft_token_ids"])
    request["draft_token_ids"][0] = (request["draft_token_ids"][0] + 1) % 512


@pytest.fixture(scope="module", params=sorted(SPEC_CONFIGS))
def spec_recording(request, tmp_path_factory):
    name = request.param
    runner, config, args = SPEC_CONFIGS[name]
    if runner == "v1" and not HAS_V1:
        pytest.skip("this vLLM release has no Model Runner V1")
    folder = tmp_path_factory.mktemp(name)
    prompts = _prompts(folder / "prompts.jsonl")
    target = tiny_mtp_target(folder) if config["method"] == "mtp" else []
    steps = record_steps(folder, prompts, STEPS, MAX_TOKENS,
                         [*target, "--dtype", "bfloat16", *GRAPHS, *speculative_args(runner, config), *args],
                         runner)
    bundles = bundles_by_step(steps)
    drafted = [path for path in bundles.values() if any(r.draft_token_ids for r in load_step(path)[1].requests)]
    assert drafted, f"{name}: no step verified drafts"
    control = rewrite_bundle(drafted[0], folder / "changed_draft.zst", _changed_draft)
    out = folder / "replays.jsonl"
    replay = tracekit("replay", steps, control, "--keep-going", "--no-timing", "--json", out, runner=runner)
    return name, bundles, drafted, control, (json_records(out) if out.exists() else {}), replay


def test_every_step_replays_bit_exact(spec_recording):
    name, bundles, drafted, _, records, replay = spec_recording
    for index, path in bundles.items():
        record = records.get(str(path))
        assert record is not None, f"{name} step {index} has no replay record\n{replay.explain()}"
        diverged = [check["item"] for check in record["checks"] if not check["bit_exact"] and check.get("decides", True)]
        assert record["verdict"] == "bit_exact", (name, index, record["verdict"], diverged, record["notes"])
    for path in drafted:
        items = {check["item"] for check in records[str(path)]["checks"]}
        assert {"spec_decode/drafts", "spec_decode/accepted", "spec_decode/proposals"} <= items, (name, path.name)


def test_the_engine_drafted_as_configured(spec_recording):
    name, bundles, drafted, _, _, _ = spec_recording
    runner, config, args = SPEC_CONFIGS[name]
    engine = read_content(drafted[0]).engine
    assert engine.engine_args["speculative_config"]["method"] == config["method"]
    # vLLM's default: async scheduling with EAGLE (V1 and V2), never with ngram
    assert engine.engine_args.get("async_scheduling") is (config["method"] != "ngram" and "--no-async-scheduling" not in args)
    steps = [load_step(path)[1] for path in bundles.values()]
    accepted = sum(len(step.outputs.sampled_token_ids[row]) - 1 for step in steps
                   for row, request in enumerate(step.requests) if request.draft_token_ids)
    if config["method"] == "ngram":
        assert accepted >= 1, name
    else:  # a model drafter proposes every step; V1 calls its model, V2 may replay FULL graphs instead
        assert all(step.spec_decode.proposals is not None for step in steps), name
        if runner == "v1":
            assert all(len(step.spec_decode.drafter_calls) == config["num_speculative_tokens"] for step in steps), name


def test_a_changed_draft_token_is_named(spec_recording):
    name, _, _, control, records, _ = spec_recording
    record = records[str(control)]
    assert record["verdict"] == "diverged" and record["first_divergence"] == "spec_decode/drafts", (name, record["first_divergence"])
