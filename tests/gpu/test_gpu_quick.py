"""The GPU run to make on every engine-facing change (`tools/gpu_run.sh --quick`): the GPU
workload recorded with vLLM's defaults — its capture sizes, async scheduling, bf16, a token
budget of 128 so the long prompt is prefilled in compiled chunks beside the others' decodes — on
Model Runner V2 and on V1 (where the release has it), every step replayed in one fresh process
and asserted bit-exact. And a float32 compiled workload, where Inductor's autotuning decides
rounding, recorded twice (two processes, each timing its own kernels) and each recording
replayed against its own bundle: bit-exact because the bundles carry the kernel choices
(`tracekit.graphs.kernel_choices`), copy by copy, without Inductor's deterministic mode. The
second recording finds the first's caches, so its kernels come back from Inductor's compile
workers, one copy per compiled graph, which can run apart (issue 28); and a bundle with one copy
of a kernel made to run apart is replayed, each copy as its bundle says.

A summary per configuration (steps, bit-exact, verdicts, seconds) is written where
TRACEKIT_GPU_SUMMARY points; `tools/gpu_run.sh --quick` turns it into tests/gpu/last-run.json.
"""

import json
import os
import time
from pathlib import Path

import pytest
from gpu_support import bundles_by_step, json_records, read_content, read_step, record_steps, tracekit

from tracekit.graphs.kernel_choices import _copy_configs

pytestmark = pytest.mark.gpu

BUDGET = ["--max-num-batched-tokens", "128"]
# name: (runner, engine arguments, recordings). vLLM's capture sizes and async scheduling as they are.
QUICK_CONFIGS = {
    "v2-bf16-defaults-128": ("v2", ["--dtype", "bfloat16", *BUDGET], 1),
    "v1-bf16-defaults-128": ("v1", ["--dtype", "bfloat16", *BUDGET], 1),
    "v2-fp32-defaults-128": ("v2", ["--dtype", "float32", *BUDGET], 2),
}
STEPS, MAX_TOKENS = "0:40", 12


def _summary_path() -> Path | None:
    path = os.environ.get("TRACEKIT_GPU_SUMMARY")
    return Path(path) if path else None


def _add_to_summary(name: str, entry: dict) -> None:
    path = _summary_path()
    if path is None:
        return
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary[name] = entry
    path.write_text(json.dumps(summary, indent=1, sort_keys=True))


def _copies_apart(steps: Path) -> dict[str, list[dict]]:
    """The kernels whose copies (one per compiled graph) ran with several configurations in the
    recording, with each copy's graph (a prefix of its key) and configuration (issue 28)."""
    bundles = bundles_by_step(steps)
    if not bundles:
        return {}
    from tracekit.graphs.kernel_choices import ran_apart

    return {choice.kernel: [{"graph": copy.graph[:12], **copy.config} for copy in choice.copies]
            for choice in read_content(list(bundles.values())[-1]).engine.kernel_choices if ran_apart(choice)}


def _decides(check: dict) -> bool:
    return check.get("decides", True)


@pytest.fixture(scope="module", params=sorted(QUICK_CONFIGS))
def quick(request, tmp_path_factory, prompts_file):
    """Each recording of the configuration, replayed in one fresh process of its own."""
    name = request.param
    runner, args, recordings = QUICK_CONFIGS[name]
    started = time.perf_counter()
    results = []
    for index in range(recordings):
        folder = tmp_path_factory.mktemp(f"{name}-{index}")
        steps = record_steps(folder, prompts_file, STEPS, MAX_TOKENS, args, runner)
        out = folder / "replays.jsonl"
        replay = tracekit("replay", steps, "--keep-going", "--no-timing", "--json", out, runner=runner)
        results.append((steps, json_records(out) if out.exists() else {}, replay))
    seconds = time.perf_counter() - started
    records = [record for _, by_bundle, _ in results for record in by_bundle.values()]
    _add_to_summary(name, {
        "runner": runner, "engine_args": args, "recordings": recordings,
        "steps": sum(len(bundles_by_step(steps)) for steps, _, _ in results),
        "bit_exact": sum(record["verdict"] == "bit_exact" for record in records),
        "bit_exact_per_recording": [sum(record["verdict"] == "bit_exact" for record in by_bundle.values())
                                    for _, by_bundle, _ in results],
        "verdicts": sorted({record["verdict"] for record in records}),
        # written before any test asserts, so that a call cut short still says which recording
        # parted where (issue 28's float32 runs part in some processes only)
        "parted": _parted_steps(results),
        "seconds": round(seconds, 1),
        # per recording, the PTX ISA of each of vLLM's own Triton kernels it built: which ptxas
        # release each process gave them (issue 28)
        # per recording, its kernels whose copies ran apart: what the replay gave each copy its own
        # configuration for (issue 49)
        "copies_apart": [_copies_apart(steps) for steps, _, _ in results],
    })
    return name, results


def _parted_steps(results) -> list[dict]:
    """Every step whose replay was not bit-exact: its recording (by index), step, verdict, first
    divergence, the deciding items that parted (with their relative RMS) and the report's notes."""
    parted = []
    for recording, (steps, records, _) in enumerate(results):
        for index, path in bundles_by_step(steps).items():
            record = records.get(str(path))
            if record is not None and record["verdict"] != "bit_exact":
                items = {check["item"]: check.get("relative_rms") for check in record.get("checks", [])
                         if not check["bit_exact"] and _decides(check)}
                parted.append({"recording": recording, "step": index, "verdict": record["verdict"],
                               "first_divergence": record.get("first_divergence"), "items": items,
                               "notes": record.get("notes") or [record.get("reason")]})
    return parted


def test_every_step_replays_bit_exact(quick):
    name, results = quick
    for steps, records, replay in results:
        bundles = bundles_by_step(steps)
        assert len(bundles) >= 10, [path.name for path in bundles.values()]
        for index, path in bundles.items():
            assert str(path) in records, f"{name} step {index} has no replay record\n{replay.explain()}"
    parted = _parted_steps(results)
    assert not parted, (name, parted)


def test_the_workload_ran_compiled_chunks_and_graphs(quick):
    """What the configuration is for: prefill chunks run compiled without a graph or as
    PIECEWISE graphs, decodes as FULL graphs (vLLM's default capture sizes)."""
    name, results = quick
    steps = [read_step(path) for path in bundles_by_step(results[0][0]).values()]
    modes = {step.graph.runtime_mode for step in steps}
    assert "FULL" in modes, (name, modes)
    assert any(step.graph.num_tokens > 64 and step.graph.runtime_mode in ("NONE", "PIECEWISE") for step in steps), name


def _untellable(choices) -> set[str]:
    """Kernels whose copies the recording itself cannot tell apart: identical graph modules bind
    one (graph, global) key, and their copies ran with several configurations."""
    return {choice.kernel for choice in choices if any(len(configs) > 1 for configs in _copy_configs(choice).values())}


def test_compiled_steps_carry_the_kernel_choices(quick):
    """Every kernel, and every copy of one, ran as recorded: none otherwise, none the replay could
    not give its configuration, and none whose copies could not be told apart — except where the
    recording itself could not tell them apart (identical graph modules, issue 49: the report then
    names the kernel with every configuration, and those must be the recorded ones)."""
    name, results = quick
    for steps, records, _ in results:
        for path in bundles_by_step(steps).values():
            record = records[str(path)]
            kernels = record.get("kernel_choices") or {}
            assert not any(kernels.get(kind) for kind in ("other", "unapplied")), (name, path.name, kernels)
            untellable = _untellable(read_content(path).engine.kernel_choices)
            for line in kernels.get("several") or []:
                kernel, _, configs = line.partition(": ")
                here, _, recorded = configs.removesuffix(" recorded").partition(" here, ")
                assert kernel in untellable, (name, path.name, line)
                assert set(here.split(" and ")) == set(recorded.split(" and ")), (name, path.name, line)


def test_each_copy_of_a_kernel_runs_as_its_bundle_says(quick, tmp_path):
    """The first recording's first step, one copy of a kernel that two compiled graphs bind (the
    norm of layer 0's and layer 1's graphs) made to run with another block size than its twin:
    the replay gives each copy its own (without it, Inductor's lookup table gives both one), as
    its report says copy by copy. Whether that changes the step's rounding is not the question
    (the verdict is not asserted): that each copy runs as its bundle says is."""
    from tracekit.format.rewrite import rewrite_bundle

    name, results = quick
    if "fp32" not in name:
        pytest.skip("one configuration is enough: the float32 one, whose second recording's copies can run apart")
    path = bundles_by_step(results[0][0])[0]
    choices = read_content(path).engine.kernel_choices
    shared = [choice for choice in choices if len({copy.graph for copy in choice.copies}) > 1 and "XBLOCK" in choice.config]
    assert shared, ("no kernel source has copies in two compiled graphs", [(c.kernel, len(c.copies)) for c in choices])
    # (halving a block size is always a configuration the kernel can launch with)
    kernel = max(shared, key=lambda choice: (choice.config["XBLOCK"] > 1, "rms_norm" in choice.kernel)).kernel
    changed = {}

    def one_copy_apart(metadata, tensors):
        (choice,) = [choice for choice in metadata["engine"]["kernel_choices"] if choice["kernel"] == kernel]
        last = choice["copies"][-1]
        xblock = last["config"].get("XBLOCK", 1)
        last["config"] = {**last["config"], "XBLOCK": xblock // 2 if xblock > 1 else 2}
        choice["other_configs"] = [copy["config"] for copy in choice["copies"] if copy["config"] != choice["config"]]
        changed.update(graph=last["graph"][:12], config=last["config"])

    edited = rewrite_bundle(path, tmp_path / "one-copy-apart.zst", one_copy_apart)
    out = tmp_path / "replay.jsonl"
    replay = tracekit("replay", edited, "--no-timing", "--json", out, runner=QUICK_CONFIGS[name][0])
    (record,) = json_records(out).values()
    kernels = record["kernel_choices"]
    assert kernel in kernels["same"], (changed, kernels, replay.explain())
    assert not any(kernels[kind] for kind in ("other", "several", "unapplied")), (changed, kernels)
