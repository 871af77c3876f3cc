"""Issue 31 on a GPU: structured outputs (JSON schema, choice, regex) and LoRA adapters, on Model
Runner V2 and V1 with vLLM's H200 defaults (FULL_AND_PIECEWISE CUDA graphs, async scheduling),
recorded with `tracekit record --prompts` and replayed bit-exact in one fresh process, every
grammar mask checked row for row; a flipped mask bit must be named. With drafts (ngram on V1 —
vLLM 0.26's V2 has no ngram — and EAGLE with the tiny draft config of tests/models on V2, over
digit prompts): the mask holds one row per draft position, and every drafted step replays
bit-exact with each row checked.

    bash tools/gpu_run.sh --vllm 0.26 -k grammar_lora    (V2 and V1)
    bash tools/gpu_run.sh --vllm 0.34 -k grammar_lora    (V2; 0.34 has no V1)

With EAGLE's dummy weights the drafts are mostly grammar-illegal: under async scheduling vLLM pads
the drafts it drops with -1 and keeps their mask rows (all tokens allowed), so a drafted request
still owns 1 + num_speculative_tokens rows — the case of vLLM #54437.
"""

import json

import pytest
from gpu_support import (
    CONFIGS,
    HAS_V1,
    INSTALLED_SERIES,
    TINY_EAGLE,
    checks_by_item,
    flip_one_allowed_token,
    grammar_kinds,
    json_records,
    make_adapter,
    read_step,
    record_steps,
    speculative_args,
    tracekit,
)

from tracekit.format.rewrite import rewrite_bundle

CONFIGURATIONS = ["v2-bf16-graphs", "v1-bf16-graphs"]  # vLLM's defaults on an H200: async scheduling on
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
JSON_SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
# Longer than the recording's token budget (64): prefilled in chunks, sampled under its grammar after.
LONG_PROMPT = "the lighthouse keeper counts the ships that pass and writes each name in a book " * 4
DIGIT_TOKENS = list(range(18, 28))  # the embedded tokenizer's "0".."9": ngram drafts repeat them


def workload(adapters: dict) -> list[dict]:
    a, b = ({"name": name, "path": str(folder)} for name, folder in sorted(adapters.items()))
    return [
        {"prompt": "Hello, my name is", "temperature": 0.0, "structured_outputs": {"json": JSON_SCHEMA}, "lora": a},
        {"prompt": "Pick one:", "temperature": 0.0, "structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        {"prompt": "A code:", "temperature": 0.8, "seed": 5, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"},
         "lora": b},
        {"prompt": "Once upon a time", "temperature": 0.0, "lora": a},
        {"prompt": "The capital of France is", "temperature": 0.9, "seed": 7},
        {"prompt": LONG_PROMPT, "temperature": 0.0, "structured_outputs": {"regex": "(yes|no) [0-9]{2}"}, "lora": b},
    ]


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module", params=CONFIGURATIONS)
def recorded(request, tmp_path_factory):
    runner, args = CONFIGS[request.param]
    if runner == "v1" and not HAS_V1:
        pytest.skip("this vLLM release has no Model Runner V1")
    work = tmp_path_factory.mktemp(f"grammar-lora-{request.param}")
    adapters = {"a": make_adapter(work / "adapter-a", seed=1), "b": make_adapter(work / "adapter-b", seed=2)}
    prompts = write_lines(work / "prompts.jsonl", workload(adapters))
    steps = record_steps(work, prompts, "0:60", 8, [*args, *LORA_ARGS], runner)
    bundles = sorted(steps.glob("step*.zst"), key=lambda path: read_step(path).index)
    masked = [path for path in bundles if read_step(path).grammar is not None]
    assert masked, "no step sampled under a grammar"
    controls = work / "controls"
    controls.mkdir()
    flipped = rewrite_bundle(masked[0], controls / "flipped.zst", flip_one_allowed_token)
    result = work / "replays.jsonl"
    replay = tracekit("replay", steps, flipped, "--keep-going", "--no-timing", "--json", result, runner=runner)
    return {"name": request.param, "bundles": bundles, "masked": masked, "flipped": flipped, "replay": replay,
            "records": json_records(result) if result.exists() else {}, "adapters": adapters}


def test_every_step_replays_bit_exact_its_grammar_mask_checked(recorded):
    records = recorded["records"]
    assert recorded["replay"].returncode == 1, recorded["replay"].explain()  # the flipped control only
    for path in recorded["bundles"]:
        record = records[str(path)]
        assert record["verdict"] == "bit_exact", (path.name, record.get("verdict_reason"), record.get("error"))
    for path in recorded["masked"]:
        assert checks_by_item(records[str(path)])["grammar_bitmask"]["bit_exact"], path.name
    assert set().union(*map(grammar_kinds, recorded["masked"])) == {"json", "grammar", "regex"}  # grammar: the choice


def test_lora_steps_ran_both_adapters_beside_a_request_without_one(recorded):
    from tracekit.integrations.vllm.records.weights import adapter_fingerprint

    fingerprints = {name: adapter_fingerprint(folder) for name, folder in recorded["adapters"].items()}
    beside = [path for path in recorded["bundles"]
              if {"a", "b", None} <= {request.lora_adapter for request in read_step(path).requests}]
    assert beside, "no step ran requests on both adapters beside one without"
    for path in beside:
        assert {adapter.name: adapter.fingerprint for adapter in read_step(path).lora_adapters} == fingerprints


def test_a_flipped_mask_bit_is_named(recorded):
    record = recorded["records"][str(recorded["flipped"])]
    assert (record["verdict"], record["first_divergence"]) == ("diverged", "grammar_bitmask"), record
    (row,) = checks_by_item(record)["grammar_bitmask"]["differing_mask_rows"]
    step = read_step(recorded["flipped"])
    assert row["req_id"] == step.grammar.request_ids[0]
    assert row["tokens_only_recorded"] == [step.extras["test_flipped_token"]]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# configuration: drafter (vLLM 0.26's Model Runner V2 has no ngram)
DRAFTED = {"v1-bf16-graphs": NGRAM, "v2-bf16-graphs": TINY_EAGLE}


@pytest.mark.parametrize("name", sorted(DRAFTED))
def test_drafted_grammar_steps_replay_bit_exact_with_a_mask_row_per_draft_position(name, tmp_path):
    runner, args = CONFIGS[name]
    if runner == "v1" and not HAS_V1:
        pytest.skip("this vLLM release has no Model Runner V1")
    digits = [DIGIT_TOKENS[(7 * i + 3 * (i // 10)) % 10] for i in range(60)]
    prompts = write_lines(tmp_path / "prompts.jsonl", [
        {"prompt_token_ids": digits, "temperature": 0.0, "structured_outputs": {"regex": "[0-9]{12}"}},
        {"prompt_token_ids": [5 + (11 * i) % 400 for i in range(40)], "temperature": 0.0},
    ])
    steps = record_steps(tmp_path, prompts, "0:60", 12, [*args, *speculative_args(runner, DRAFTED[name])],
                         runner)
    drafted = []
    for path in steps.glob("step*.zst"):
        step = read_step(path)
        scheduled = step.scheduler_output.scheduled_spec_decode_tokens
        if step.grammar is not None and scheduled:
            drafted.append(path)
            # vLLM 0.34 gives each request a fixed block of 1 + k rows; 0.26 one row per draft and one more
            expected = ([1 + DRAFTED[name]["num_speculative_tokens"]] * len(step.grammar.request_ids)
                        if INSTALLED_SERIES == "0.34" else [1 + len(scheduled.get(r, ())) for r in step.grammar.request_ids])
            assert step.grammar.rows_per_request == expected
    assert any(max(read_step(path).grammar.rows_per_request) > 1 for path in drafted), "no drafted grammar step"
    result = tmp_path / "replays.jsonl"
    replay = tracekit("replay", steps, "--keep-going", "--no-timing", "--json", result, runner=runner)
    assert replay.returncode == 0, replay.explain()
    records = json_records(result)
    assert {record["verdict"] for record in records.values()} == {"bit_exact"}
    for path in drafted:
        assert checks_by_item(records[str(path)])["grammar_bitmask"]["bit_exact"], path.name
