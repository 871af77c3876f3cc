"""Issue 12 on real engines: `shrink` finds a built-in bug's request and chunk (a fault injected
into the forward only when one request's poison token is in the batch: it raises, or writes a
NaN, or skews the eager forward only), twice the same; refuses a property that does not hold;
and both `shrink` and `redact` work on steps of every kind the replay supports — the redacted
ones replay bit-exact, the shrunk ones with exactly the inputs the runner builds for them (on
Model Runner V2 too)."""

import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from e2e_support import (
    STEP_KINDS,
    assert_replayed_bit_exact,
    engine_script,
    has_penalties,
    of_kind,
    read_content,
    read_step,
)

from tracekit.format import open_bundle
from tracekit.format.rewrite import rewrite_bundle
from tracekit.format.schema import SamplingParamsRecord
from tracekit.share.redact import NEUTRAL_TOKEN_ID, redact
from tracekit.share.shrink import shrink

pytestmark = pytest.mark.slow

KIND_HOLDS = Path(__file__).parent / "step_kind_holds.py"
# Kinds a default-engine workload produces (the resumed step needs the small-cache engine).
DEFAULT_ENGINE_KINDS = [kind for kind in STEP_KINDS if kind != "resumed_after_preemption"]
# Shrinking does not depend on the runner kind (a `command:` property needs no engine); what
# does is how the shrunk step replays. V1 shrinks every kind; V2, to keep CI short, the kinds
# whose replay restores the most runner state: a mixed batch, a prefix-cache hit, a resumed request.
SHRUNK_ON_V2 = ("mixed", "prefix_cache_hit", "resumed_after_preemption")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The built-in bugs, shrunk on V1 (what `shrink` does does not depend on the runner kind;
    the runner-kind parametrized tests below cover V2's steps)."""
    work = tmp_path_factory.mktemp("share")
    return {**engine_script("share_faults", work / "share_faults.json", work), "work": work}


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def poisoned_request(step, faults):
    (request,) = [
        r for r in step.requests
        if len(r.prompt_token_ids) > faults["poison_position"]
        and r.prompt_token_ids[faults["poison_position"]] == faults["poison_token"]
    ]
    return request


def assert_shrunk_to_the_poisoned_chunk(faults, source, name, until):
    report = faults[name]
    recorded = read_step(source)
    poisoned = poisoned_request(recorded, faults)
    assert poisoned.num_computed_tokens <= faults["poison_position"] < poisoned.num_computed_tokens + poisoned.num_scheduled_tokens
    shrunk = read_content(faults["work"] / name)
    (request,) = shrunk.steps[0].requests
    assert request.req_id == poisoned.req_id
    # the chunk still starts where the KV cache ends and now stops right after the poison
    assert request.num_scheduled_tokens == faults["poison_position"] - poisoned.num_computed_tokens + 1
    assert (report["requests_before"], report["requests_after"]) == (len(recorded.requests), 1)
    assert (report["tokens_before"], report["tokens_after"]) == (
        sum(r.num_scheduled_tokens for r in recorded.requests), request.num_scheduled_tokens)
    (derivation,) = shrunk.derivations
    assert derivation["kind"] == "shrink" and derivation["property"] == until
    assert derivation["from"] == {"file": source.name, "sha256": sha256(source), "step": recorded.index}
    assert derivation["replays"] == report["replays"] > 1
    assert shrunk.steps[0].outputs is None
    return shrunk.steps[0]


def test_raises_shrinks_to_the_poisoned_request_and_chunk(faults):
    assert faults["recording_raised"] == faults["injected_error"]
    step = assert_shrunk_to_the_poisoned_chunk(faults, faults["work"] / "raises.zst", "raises-small1.zst", "raises")
    assert step.error["message"] == faults["injected_error"]


def test_a_second_shrink_gives_the_same_bundle_byte_for_byte(faults):
    first, second = faults["raises-small1.zst"], faults["raises-small2.zst"]
    assert {**first, "seconds": 0, "output": ""} == {**second, "seconds": 0, "output": ""}
    assert sha256(faults["work"] / "raises-small1.zst") == sha256(faults["work"] / "raises-small2.zst")


def test_nonfinite_shrinks_to_the_poisoned_request_and_chunk(faults):
    assert_shrunk_to_the_poisoned_chunk(faults, faults["work"] / "mixed.zst", "nan-small.zst", "nonfinite")


def test_nonfinite_shrinks_a_window_to_the_step_and_request_that_show_it(faults):
    """The window's second step holds the poison: the shrunk bundle is that step alone, rebuilt on
    the KV cache a bit-exact replay of the first left, with the poisoned request alone."""
    window = read_step(faults["work"] / "window.zst")
    shown = window.index + 1
    shrunk = read_content(faults["work"] / "window-nan-small.zst")
    (step,) = shrunk.steps
    assert step.index == shown and not step.later
    (request,) = step.requests
    assert request.req_id == poisoned_request(window, faults).req_id
    (derivation,) = shrunk.derivations
    assert derivation["target"] == f"step {shown} non-finite" and derivation["first_step_kv"] == "replayed"
    assert (derivation["steps_before"], derivation["steps_after"]) == (window.window_indices, [shown])
    assert (derivation["requests_before"], derivation["requests_after"]) == (len(window.requests), 1)


def test_modes_differ_shrinks_to_the_request_whose_eager_forward_is_skewed(faults):
    assert_shrunk_to_the_poisoned_chunk(faults, faults["work"] / "mixed.zst", "modes-small.zst", "modes-differ")


def test_a_property_that_does_not_hold_on_the_replayed_bundle_is_refused(faults):
    refusal = faults["refusal"]
    assert refusal is not None and refusal["exit_code"] == 2
    assert "does not hold" in refusal["message"] and "nothing written" in refusal["message"]
    assert not faults["refused_written"]


def first_of_each_kind(bundles: dict[int, Path], kinds) -> dict[str, Path]:
    chosen = {}
    for kind in kinds:
        found = of_kind(bundles, kind)
        if found:
            chosen[kind] = next(iter(found.values()))
    return chosen


def fill_history(metadata, tensors):
    """Every token id a penalised request computed in earlier steps replaced by the token it
    samples in this one: its penalties now push that very token down."""
    step = metadata["steps"][0]
    for row, request in enumerate(step["requests"]):
        sampled = step["outputs"]["sampled_token_ids"][row]
        if has_penalties(SimpleNamespace(sampling_params=SamplingParamsRecord.from_plain(request["sampling_params"]))) and sampled:
            tokens = request["prompt_token_ids"] + request["output_token_ids"]
            computed = request["num_computed_tokens"]
            tokens[:computed] = [sampled[0]] * computed
            prompt_length = len(request["prompt_token_ids"])
            request["prompt_token_ids"], request["output_token_ids"] = tokens[:prompt_length], tokens[prompt_length:]


def shrink_keeping_kind(kind, source, out):
    until = f"command:{sys.executable} {KIND_HOLDS} {kind} {{bundle}}"
    shrink(source, out, until)
    return out


@pytest.fixture(scope="module")
def shared(e2e_dir, runner_kind, builtin_bundles, prefix_cache_bundles, preemption_bundles):
    """Of every kind of step: the first bundle, redacted and shrunk (keeping its kind; on V2 the
    kinds of `SHRUNK_ON_V2`); replayed on one engine per engine configuration, beside negative
    controls (penalised histories changed)."""
    work = e2e_dir / "shared"
    work.mkdir()
    default = {**builtin_bundles, **{1000 + i: p for i, p in prefix_cache_bundles.items()}}
    sources = first_of_each_kind(default, DEFAULT_ENGINE_KINDS)
    resumed = first_of_each_kind(preemption_bundles, ["resumed_after_preemption"])
    assert set(sources) == set(DEFAULT_ENGINE_KINDS) and resumed, "a kind of step is missing"
    made = {"redacted": {}, "shrunk": {}}
    for kind, path in {**sources, **resumed}.items():
        made["redacted"][kind] = work / f"redacted-{kind}.zst"
        redact(path, made["redacted"][kind])
        if runner_kind == "v1" or kind in SHRUNK_ON_V2:
            made["shrunk"][kind] = shrink_keeping_kind(kind, path, work / f"shrunk-{kind}.zst")
    # Negative controls: the steps with penalties, the history of penalised requests changed.
    made["history_changed"] = [
        rewrite_bundle(path, work / f"history-changed-{index}.zst", fill_history)
        for index, path in of_kind(builtin_bundles, "penalties").items()
    ]
    default_bundles = [*(made["redacted"][k] for k in sources), *(made["shrunk"][k] for k in sources if k in made["shrunk"]),
                       *made["history_changed"]]
    resumed_bundles = [made["redacted"]["resumed_after_preemption"], made["shrunk"]["resumed_after_preemption"]]
    made["replays"] = {
        **engine_script("replay_many", e2e_dir / "shared_default.json", *default_bundles, runner=runner_kind)["replays"],
        **engine_script("replay_many", e2e_dir / "shared_resumed.json", *resumed_bundles, runner=runner_kind)["replays"],
    }
    made["sources"] = {**sources, **resumed}
    return made


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_redacted_step_of_every_kind_replays_bit_exact(kind, shared):
    path = shared["redacted"][kind]
    assert_replayed_bit_exact({"replays": shared["replays"]}, {0: path})


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_redacted_step_holds_no_request_id_and_no_token_it_does_not_read(kind, shared):
    source, redacted = read_step(shared["sources"][kind]), read_content(shared["redacted"][kind])
    with open_bundle(shared["redacted"][kind]) as reader:
        stored = msgpack.packb(reader.metadata)
    assert not [req_id for req_id in source.batch_order if req_id.encode() in stored]
    (derivation,) = redacted.derivations
    kept = {req_id for entry in derivation["steps"] for req_id in entry["history_kept"]}
    for old, new in zip(source.requests, redacted.steps[0].requests):
        tokens = new.prompt_token_ids + new.output_token_ids
        start, end = old.num_computed_tokens, old.num_computed_tokens + old.num_scheduled_tokens
        assert tokens[start:end] == (old.prompt_token_ids + old.output_token_ids)[start:end]
        if new.req_id not in kept:
            assert set(tokens[:start] + tokens[end:]) <= {NEUTRAL_TOKEN_ID}


def test_changing_the_history_penalties_read_changes_what_is_sampled(shared):
    """Why penalised requests keep their earlier token ids: the forward does not read them (its
    outputs stay bit-exact), sampling does (the sampled ids change)."""
    assert shared["history_changed"], "the workload has no step with penalties"
    for path in shared["history_changed"]:
        result = shared["replays"][str(path)]
        checks = {check["item"]: check for check in result["checks"]}
        assert checks["hidden_states"]["bit_exact"] and checks["logits"]["bit_exact"]
        assert result["first_divergence"] == "sampled_token_ids", path.name


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_shrunk_step_of_every_kind_replays_with_the_inputs_the_runner_builds(kind, shared):
    if kind not in shared["shrunk"]:
        pytest.skip(f"V2 shrinks only {', '.join(SHRUNK_ON_V2)} (shrinking itself does not depend on the runner)")
    shrunk = read_content(shared["shrunk"][kind])
    assert STEP_KINDS[kind](shrunk.steps[0])
    assert len(shrunk.steps[0].requests) <= len(read_step(shared["sources"][kind]).requests)
    result = shared["replays"][str(shared["shrunk"][kind])]
    assert "error" not in result, result
    checks = {check["item"]: check for check in result["checks"]}
    assert all(checks[item]["bit_exact"] for item in ("batch_order", "input_ids", "positions"))
    assert result["reproduced"]
