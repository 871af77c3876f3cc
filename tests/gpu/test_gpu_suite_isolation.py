"""Issue 49 item 1 on the GPU: a suite replay isolates its bundles. A drafted workload — a ~300
token prompt prefilled in chunks beside short greedy and seeded requests, bf16, tracekit's small
engine, vLLM's CUDA graphs — is recorded step by step, and its folder replayed in name order (as
`tracekit replay DIR` does), in reverse order and each bundle alone in a fresh process: every
bundle must be bit-exact all three ways (`suite_orders`, as the CPU test
`tests/e2e/test_suite_isolation.py`).

Found under 0.34 with ngram on Model Runner V2 (steps 1-4 `diverged` at `spec_decode/proposals` in
the folder, bit-exact alone): a slot a finished request frees keeps its last sampled token, which
V2's ngram drafter proposes for a prefill chunk; the replay now puts it back per request and a
replay engine puts those slot buffers back as it held them before its first replay.

Configurations: V2 ngram (0.34: 0.26's V2 has no ngram), V2 EAGLE (both), V1 ngram (0.26: V1 only
there). Six steps each (the leak showed in steps 1-4): 9 processes a configuration, and one more
(with its fresh child) for a tampered bundle replayed alone (issue 49 item 3).
"""

import json
import random

import pytest
from gpu_support import HAS_V1, INSTALLED_SERIES, TINY_EAGLE, record_steps, speculative_args, tracekit
from suite_orders import not_isolated, replay_three_ways

from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# name: (runner, speculative config)
CONFIGS = {"v2-ngram": ("v2", NGRAM), "v2-eagle": ("v2", TINY_EAGLE), "v1-ngram": ("v1", NGRAM)}


def _prompts(path):
    """A ~300-token prompt (its greedy continuation repeats, so drafts are verified) between
    short requests, greedy and seeded: the small engine's 64-token budget prefills it in chunks
    beside their decodes."""
    draw = random.Random(3)
    sampling = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}, {"temperature": 0.0}, {"temperature": 0.0}]
    lines = [{"prompt_token_ids": [draw.randrange(3, 512) for _ in range(length)], "ignore_eos": True, **params}
             for length, params in zip((8, 12, 300, 16), sampling)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def recorded(request, tmp_path_factory):
    """(runner, work folder, steps folder) of one configuration, six steps recorded."""
    name = request.param
    runner, config = CONFIGS[name]
    if runner == "v1" and not HAS_V1:
        pytest.skip(f"vLLM {INSTALLED_SERIES} has no Model Runner V1")
    if name == "v2-ngram" and INSTALLED_SERIES == "0.26":
        pytest.skip("vLLM 0.26's Model Runner V2 has no ngram drafter")
    work = tmp_path_factory.mktemp(name)
    steps = record_steps(work, _prompts(work / "prompts.jsonl"), "0:6", 8,
                         ["--dtype", "bfloat16", *speculative_args(runner, config)], runner)
    return runner, work, steps


def test_every_bundle_of_a_drafted_folder_is_bit_exact_in_name_order_in_reverse_order_and_alone(recorded):
    runner, work, steps = recorded
    records, finished = replay_three_ways(steps, work / "replays", lambda *args: tracekit(*args, runner=runner))
    names = sorted(path.name for path in steps.glob("*.zst"))
    assert len(names) == 6, names
    assert not_isolated(records, names) == [], [f.explain() for f in finished if f.returncode]
    assert all(f.returncode == 0 for f in finished), [f.explain() for f in finished if f.returncode]


def _another_token_recorded(metadata, tensors):
    sampled = metadata["steps"][0]["outputs"]["sampled_token_ids"]
    sampled[0][0] = (sampled[0][0] + 1) % 512


def test_a_divergence_replayed_alone_is_replayed_again_here_and_in_a_fresh_process(recorded):
    """Issue 49 item 3 on a device: a bundle whose recorded token was changed diverges in every
    replay — twice more on the same engine, then (the engine released: a device holds one) three
    times in a fresh process — so it stays `diverged`, exit 1, never `nondeterministic`."""
    runner, work, steps = recorded
    tampered = rewrite_bundle(sorted(steps.glob("*.zst"))[-1], work / "tampered.zst", _another_token_recorded)
    out = work / "tampered.jsonl"
    finished = tracekit("replay", tampered, "--no-timing", "--json", out, runner=runner)
    record = json.loads(out.read_text())
    assert finished.returncode == 1 and record["verdict"] == "diverged", finished.explain()
    repeats = record["repeats"]
    assert repeats["disagreement"] is None and not repeats["failures"], repeats
    assert [run["where"] for run in repeats["runs"]] == ["this process"] * 3 + ["a fresh process"] * 3, repeats
