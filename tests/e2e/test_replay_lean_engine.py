"""Issue 20, part 3: a replay builds a lean engine (only what its steps need), and the lean engine
runs a step exactly as the engine vLLM builds (`--full-engine`) does.

A real compiled CPU engine (the CPU build has no CUDA graphs, so the lean build narrows its
compile sizes here; tests/gpu/test_gpu_lean_engine.py covers the graphs): two requests recorded
with `compile_sizes` [2, 16], so their decode steps (2 tokens) run the single-size code of size 2
and the prefill step the code of its compile range. A lean suite keeps compile size 2 only (16 is
no step's size); both engines replay every step bit-exact against the recording, their common
reference, so they gave bit-identical outputs for each. V1 only: what is built does not depend
on the runner kind on CPU (V2's lean graphs run on the GPU)."""

import json

import pytest
from e2e_support import CORE_ITEMS, bundles_by_step, tracekit

pytestmark = [pytest.mark.slow]

COMPILE_SIZES = [2, 16]
PROMPTS = ["The capital of France is", "One, two, three, four,"]


@pytest.fixture(scope="module")
def sized_bundles(tmp_path_factory):
    """Every step of two greedy requests, compiled with `COMPILE_SIZES`."""
    folder = tmp_path_factory.mktemp("lean")
    prompts = folder / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    finished = tracekit(
        "record", "--prompts", prompts, "--max-tokens", 3, "--steps", "0:3", "-o", folder / "step{step}.zst",
        "--compilation-config", json.dumps({"compile_sizes": COMPILE_SIZES}),
    )
    assert finished.returncode == 0, finished.explain()
    return bundles_by_step(folder)


def replay_records(bundles, tmp_path, *flags):
    out = tmp_path / f"replay{''.join(flags)}.jsonl"
    finished = tracekit("replay", *bundles, "--no-timing", "--keep-going", "--json", out, *flags)
    assert finished.returncode == 0, finished.explain()
    return {record["bundle"]: record for record in map(json.loads, out.read_text().splitlines())}


def test_lean_and_full_engines_replay_every_step_bit_identically(sized_bundles, tmp_path):
    bundles = [str(path) for path in sized_bundles.values()]
    lean = replay_records(bundles, tmp_path)
    full = replay_records(bundles, tmp_path, "--full-engine")
    for bundle in bundles:
        for name, record in (("lean", lean[bundle]), ("full", full[bundle])):
            items = {check["item"] for check in record["checks"]}
            assert CORE_ITEMS <= items, f"{name} replay of {bundle} compared only {sorted(items)}"
            diverged = [check for check in record["checks"] if not check["bit_exact"]]
            assert record["bit_exact"] and not diverged, f"{name} replay of {bundle} diverged: {diverged}"
        assert lean[bundle]["reference_mode"] == full[bundle]["reference_mode"] == "compiled"
        # The same dispatch (the attention metadata holds addresses on CPU: not compared).
        assert lean[bundle]["dispatch"]["differences"] == full[bundle]["dispatch"]["differences"] == []
    decode_sizes = {lean[b]["dispatch"]["recorded"]["num_tokens"] for b in bundles[1:]}
    assert decode_sizes == {2}, "the decode steps did not run at compile size 2"

    # One engine per configuration, built for the union of the steps' needs.
    builds = [record["engine_build"] for record in lean.values()]
    assert [build["built_for_this_step"] for build in builds] == [True] + [False] * (len(builds) - 1)
    assert all(build["kind"] == "lean" for build in builds)
    assert builds[0]["compile_sizes"] == [2]  # 16 is no step's size
    assert builds[0]["graphs_captured"] is None  # a CPU engine captures no graphs
    assert "VLLM_DISABLE_COMPILE_CACHE" not in builds[0]["env"]  # no kernel choices: vLLM's cache serves
    assert full[bundles[0]]["engine_build"]["kind"] == "full" and full[bundles[0]]["engine_build"]["compile_sizes"] is None
    # The lean engine's own settings are not reported as numerics-affecting differences.
    assert not [d for record in lean.values() for d in record["environment_differences"] if d["affects_numerics"]]


def test_report_names_the_engine_built():
    from tracekit.cli.replay_report import describe_engine_build

    lean = {"kind": "lean", "graphs_captured": [["FULL", 8], ["PIECEWISE", 8]], "compile_sizes": None, "seconds": 12.34,
            "built_for_this_step": True}
    assert describe_engine_build(lean).startswith("lean (captured FULL 8, PIECEWISE 8; --full-engine")
    assert describe_engine_build(lean).endswith("built in 12.3 s")
    assert describe_engine_build({**lean, "import_seconds": 4.56}).endswith("built in 12.3 s (4.6 s of it importing vLLM)")
    assert describe_engine_build({**lean, "built_for_this_step": False}).endswith(", reused")
    assert describe_engine_build({"kind": "full", "seconds": 1.0}).startswith("full (as vLLM builds it")


# One recorded choice of an Inductor kernel whose copies in two compiled graphs ran apart (a CPU
# engine builds no Triton kernels: it matches none, its graphs bind no copy, and the steps are
# compiled all the same, every graph module it loads read for copies to give their own).
A_KERNEL_CHOICE = {"kernel": "triton_red_fused_0", "source_hash": "ab" * 32,
                   "config": {"XBLOCK": 8, "num_warps": 4, "num_stages": 1}, "origin": "timed",
                   "other_configs": [{"XBLOCK": 16, "num_warps": 4, "num_stages": 1}],
                   "copies": [{"graph": "1" * 64, "binding": "triton_red_fused_0",
                               "config": {"XBLOCK": 8, "num_warps": 4, "num_stages": 1}},
                              {"graph": "2" * 64, "binding": "triton_red_fused_0",
                               "config": {"XBLOCK": 16, "num_warps": 4, "num_stages": 1}}]}


def test_steps_with_kernel_choices_are_replayed_by_code_compiled_here(sized_bundles, tmp_path):
    """vLLM's compile cache is keyed by the engine configuration, not by the kernel choices a
    step carries: an engine replaying such steps compiles its own code (nothing is loaded from
    the cache another process filled), and is as bit-exact as any."""
    from tracekit.format.rewrite import rewrite_bundle
    from tracekit.integrations.vllm.engines.lean_build import COMPILE_HERE_ENV

    def with_a_choice(metadata, tensors):
        metadata["engine"]["kernel_choices"] = [A_KERNEL_CHOICE]

    bundles = [str(rewrite_bundle(path, tmp_path / path.name, with_a_choice)) for path in sized_bundles.values()]
    records = replay_records(bundles, tmp_path)
    for bundle in bundles:
        record = records[bundle]
        assert record["bit_exact"] and record["reference_mode"] == "compiled", record.get("first_divergence")
        assert COMPILE_HERE_ENV.items() <= record["engine_build"]["env"].items(), record["engine_build"]
        assert not [d for d in record["environment_differences"] if d["affects_numerics"]]
        assert record["kernel_choices"]["unapplied"] == [], record["kernel_choices"]
