"""Issue 33: every field of the content schema is checked against its declared type (and range)
when a bundle's metadata becomes schema records, containers included, so a stranger's bundle of
wrong types is refused in one line naming the field (exit 2) before any command uses a value."""

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracekit.cli import main
from tracekit.errors import BundleError
from tracekit.format import open_bundle
from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle
from tracekit.format.schema import BundleContent

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"
ISSUE_FIELD = "bundle.steps[0].requests[0].output_token_ids"


def _run(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args], terminal_width=200)
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("value", [2147483647, -2147483647, 274877906944])  # the fuzzing campaign's three
def test_output_token_ids_given_an_int_are_refused_in_one_line_by_every_command(tmp_path, value):
    """They passed the reader and crashed `tracekit inspect` (RequestState.is_prefill: len() of
    an int), a traceback with exit 1 that `git bisect run` reads as "bug present"."""
    def set_int(metadata, tensors):
        metadata["steps"][0]["requests"][0]["output_token_ids"] = value

    bundle = rewrite_bundle(SAMPLE, tmp_path / "int.zst", set_int)
    expected = f"tracekit: error: bundle content: {ISSUE_FIELD} should be a list, not an int ({value})\n"
    for args in (["inspect"], ["inspect", "--json"], ["inspect", "--json", "--full"], ["inspect", "--verify"],
                 ["export", "-o", "-"]):
        code, _, stderr = _run(args[0], bundle, *args[1:])
        assert (code, stderr) == (2, expected), args
    with pytest.raises(BundleError) as refused:
        load_step(bundle)  # what `tracekit replay` reads first
    assert str(refused.value) == expected.removeprefix("tracekit: error: ").strip()
    code, _, _ = _run("diff", bundle, SAMPLE, "--json")  # compares plain metadata, tensors equal
    assert code == 0


def test_replay_refuses_the_issue_bundle_in_one_line_before_building_anything(tmp_path):
    """What `git bisect run tracekit replay` reads: exit 2 (bad input), not 1 (not reproduced)."""
    bundle = rewrite_bundle(SAMPLE, tmp_path / "int.zst",
                            lambda metadata, tensors: metadata["steps"][0]["requests"][0].update(output_token_ids=2147483647))
    finished = subprocess.run([str(Path(sys.executable).with_name("tracekit")), "replay", "--no-timing", str(bundle)],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == f"tracekit: error: bundle content: {ISSUE_FIELD} should be a list, not an int (2147483647)\n"


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open_bundle(SAMPLE) as reader:
        return reader.metadata


def _request(metadata: dict, number: int = 0) -> dict:
    return metadata["steps"][0]["requests"][number]


@pytest.mark.parametrize("edit, problem", [
    # scalars: a bool is no int, an int outside 64 bits no int, a float no int
    (lambda m: _request(m).update(num_computed_tokens=True), "requests[0].num_computed_tokens should be an int, not a bool (True)"),
    (lambda m: _request(m).update(num_computed_tokens=1.0), "requests[0].num_computed_tokens should be an int, not a float (1.0)"),
    (lambda m: m["steps"][0].update(index=2**64 - 1), "steps[0].index should be from -9223372036854775808 to 9223372036854775807"),
    (lambda m: m["steps"][0]["outputs"].update(finite=1), "outputs.finite should be a bool, not an int (1)"),
    (lambda m: m["steps"][0]["timing"].update(step_us="3"), "timing.step_us should be a number or nil, not a str ('3')"),
    # ranges: counts never negative, ids int32, a block size a divisor
    (lambda m: _request(m).update(num_scheduled_tokens=-1), "requests[0].num_scheduled_tokens should be from 0 to 2147483647, not -1"),
    (lambda m: m["engine"].update(block_size=0), "bundle.engine.block_size should be from 1 to 2147483647, not 0"),
    (lambda m: _request(m)["prompt_token_ids"].append(2**31), "prompt_token_ids[12] should be from -2147483648 to 2147483647"),
    # containers, nested: list[list[int]], dict[str, str], str keys
    (lambda m: _request(m).update(block_ids=[[1, "x"]]), "requests[0].block_ids[0][1] should be an int, not a str ('x')"),
    (lambda m: _request(m).update(block_ids=[1]), "requests[0].block_ids[0] should be a list, not an int (1)"),
    (lambda m: m["environment"]["env_vars"].update(A=1), "environment.env_vars['A'] should be a str, not an int (1)"),
    (lambda m: m["environment"]["env_vars"].update({5: "x"}), "environment.env_vars should have str keys, not an int"),
    (lambda m: m["steps"][0]["outputs"].update(sampled_token_ids=[[1, None]]),
     "outputs.sampled_token_ids[0][1] should be an int, not nil"),
    (lambda m: m["steps"][0]["outputs"].update(sampled_token_ids=7), "outputs.sampled_token_ids should be a list or nil, not an int"),
    # records and maps of named fields
    (lambda m: m["steps"][0].update(kv=[]), "steps[0].kv should be a map, not a list"),
    (lambda m: m.update(parallel=None), "bundle.parallel should be a map, not nil"),
    (lambda m: m["steps"][0].update(error={"type": ["x"]}), "steps[0].error.type should be a str, not a list"),
    (lambda m: m["steps"][0]["graph"]["batch_descriptor"].update(num_tokens="64"),
     "batch_descriptor.num_tokens should be an int, not a str"),
    (lambda m: _request(m, 1).update(runner_state={"seed": "7"}), "requests[1].runner_state.seed should be an int"),
    (lambda m: _request(m, 1).update(runner_state=[]), "requests[1].runner_state should be a map, not a list"),
    # tensors: a reference, nothing else
    (lambda m: m["steps"][0].update(input_ids=[1, 2]), "steps[0].input_ids should be a tensor reference or nil, not a list"),
    (lambda m: m["steps"][0].update(positions={"$tensor": 3}), "positions should be a tensor reference or nil, not a map"),
    (lambda m: _request(m, 1).update(generator_state=b"\0"), "runner_state.generator_state should be a tensor reference, not a bin"),
    (lambda m: m["steps"][0]["rng"].update(cpu=None), "rng['cpu'] should be a tensor reference, not nil"),
    # a field the schema leaves open is still a map of str keys
    (lambda m: m["engine"].update(engine_args={1: 2}), "engine.engine_args should have str keys"),
    (lambda m: m["engine"].pop("num_kv_blocks"), "bundle.engine lacks required field(s) num_kv_blocks"),
], ids=lambda value: None if callable(value) else value.split(" should ")[0].split(" lacks")[0][-40:])
def test_a_wrong_type_or_value_anywhere_is_refused_naming_its_place(recorded, edit, problem):
    metadata = copy.deepcopy(recorded)
    edit(metadata)
    with pytest.raises(BundleError, match=re.escape(problem)) as refused:
        BundleContent.from_plain(metadata)
    assert str(refused.value).startswith("bundle content: bundle.") and "\n" not in str(refused.value)


@pytest.mark.parametrize("edit", [
    lambda m: m["steps"][0]["timing"].update(forward_us=1756),  # an int where a float belongs
    lambda m: m["steps"][0]["outputs"].update(logits=None, sampled_token_ids=None),  # optional: nil
    lambda m: _request(m, 1).update(runner_state={"seed": -5, "added_later": [1]}),  # a name a newer tracekit keeps
    lambda m: m["steps"][0]["graph"]["batch_descriptor"].update(num_tokens=64, new_vllm_field={"a": 1}),
    lambda m: m["steps"][0]["kv"].update(mode="a later mode"),  # a new value of a string field
    lambda m: _request(m).update(output_token_ids=[-1]),  # V1's placeholder under async scheduling
    lambda m: m.update(added_in_a_later_schema={"x": [1]}),
], ids=["int-as-float", "nil-optional", "runner-state-extras", "descriptor-extras", "new-kv-mode", "placeholder", "extras"])
def test_what_the_schema_allows_is_read(recorded, edit):
    metadata = copy.deepcopy(recorded)
    edit(metadata)
    assert BundleContent.from_plain(metadata).to_plain()["steps"][0]["index"] == 1


def test_a_loaded_tensor_is_a_tensor_and_a_version_1_runner_field_moves(recorded):
    """`load_step` builds its step again from the metadata with the tensors loaded: a tensor
    there passes as one. Schema version 1's `generator_state` moves into `runner_state`."""
    _, step = load_step(SAMPLE)
    assert step.input_ids.dtype is not None and step.requests[1].runner_state["generator_state"].numel() > 0
    assert "generator_state" not in step.requests[0].runner_state  # nil there: not moved


def test_every_recorded_trace_reads():
    for bundle in sorted((SAMPLE.parent).rglob("*.zst")):
        with open_bundle(bundle) as reader:
            if BundleContent.claimed_by(reader.metadata):
                assert BundleContent.from_plain(reader.metadata).steps, bundle
                load_step(bundle)
            else:  # the golden files hold metadata of their own
                assert bundle.name.startswith("golden-"), bundle


def test_metadata_holding_none_of_the_contents_fields_is_shown_as_other_data(small_bundle):
    code, stdout, _ = _run("inspect", small_bundle)
    assert code == 0 and "not a recorded engine step" in stdout
