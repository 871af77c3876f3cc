"""What a replay takes from a bundle's kernel choices (they come from strangers: numbers only,
and only those a Triton launch configuration can be), and how it reports, kernel by kernel, a
configuration that differs from the recorded one. Runs anywhere; the choices themselves are
read and applied on a GPU (test_gpu_kernel_choices.py)."""

import pytest

from tracekit.format.schema import KernelChoice
from tracekit.graphs.kernel_choices import compare, lookup_table

KEY = "ab" * 32
GOOD = {"XBLOCK": 8, "R0_BLOCK": 512, "num_warps": 4, "num_stages": 1}


def test_a_valid_choice_becomes_a_lookup_entry():
    assert lookup_table([KernelChoice("triton_red_fused_0", KEY, GOOD)]) == {KEY: GOOD}


@pytest.mark.parametrize("source_hash, config", [
    ("not-a-sha256", GOOD),
    (KEY.upper(), GOOD),
    (KEY, {**GOOD, "XBLOCK": 12}),  # not a power of two
    (KEY, {**GOOD, "num_warps": 3}),
    (KEY, {**GOOD, "num_warps": 64}),
    (KEY, {**GOOD, "R0_BLOCK": 1 << 20}),
    (KEY, {**GOOD, "num_stages": 0}),
    (KEY, {**GOOD, "num_stages": 99}),
    (KEY, {**GOOD, "XBLOCK": True}),
    (KEY, {**GOOD, "XBLOCK": -8}),
    (KEY, {"XBLOCK": 8}),  # no warps or stages
])
def test_a_choice_no_launch_configuration_can_be_is_left_out(source_hash, config):
    assert lookup_table([KernelChoice("k", source_hash, config)]) == {}


def test_kernels_are_compared_by_their_hash_and_named():
    recorded = [KernelChoice("a", "1" * 64, GOOD), KernelChoice("b", "2" * 64, GOOD)]
    here = [KernelChoice("a", "1" * 64, GOOD), KernelChoice("b", "2" * 64, {**GOOD, "XBLOCK": 16}),
            KernelChoice("c", "3" * 64, GOOD)]
    outcome = compare(recorded, here)
    assert outcome["same"] == ["a"] and outcome["unrecorded"] == ["c"]
    assert outcome["other"] == [
        "b: XBLOCK=16,R0_BLOCK=512,num_warps=4,num_stages=1 here, XBLOCK=8,R0_BLOCK=512,num_warps=4,num_stages=1 recorded"
    ]


# -- copies of one kernel source (issue 28) -------------------------------------------------------
# A process that loads its compiled graphs from vLLM's compile cache holds one copy of a kernel
# per graph, each configured on its own: on an H100 one float32 recording ran the layer-0 copy of
# a norm with XBLOCK=1 and the layer-1 copy with XBLOCK=32. Real CachingAutotuner objects, built
# without a GPU, in modules of Inductor's real code cache.

SOURCE = "def triton_per_fused_add_rms_norm_0(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):\n    pass\n"


def _copy_of_the_kernel(xblock: int):
    from types import SimpleNamespace

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, Config

    autotuner = object.__new__(CachingAutotuner)
    autotuner.fn = SimpleNamespace(src=SOURCE, __name__="triton_per_fused_add_rms_norm_0")
    autotuner.size_hints = {"x": 128, "r0_": 128}
    autotuner.launchers = [SimpleNamespace(config=Config({"XBLOCK": xblock}, num_warps=2, num_stages=1))]
    autotuner.autotune_cache_info = {"autotune_cache_state": "hit"}
    return autotuner


@pytest.fixture
def graphs_holding(monkeypatch):
    """Put each copy in a compiled graph's module of its own, in load order."""
    from types import ModuleType

    from torch._inductor.codecache import PyCodeCache

    def load(*copies):
        modules = []
        for number, autotuner in enumerate(copies):
            module = ModuleType(f"graph_{number}")
            module.triton_per_fused_add_rms_norm_0 = autotuner
            modules.append(module)
        monkeypatch.setattr(PyCodeCache, "modules", modules)
    return load


def test_copies_that_ran_alike_record_one_configuration(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices

    graphs_holding(_copy_of_the_kernel(8), _copy_of_the_kernel(8))
    [choice] = launched_choices()
    assert choice.config == {"XBLOCK": 8, "num_warps": 2, "num_stages": 1} and choice.other_configs == []


def test_copies_that_ran_otherwise_keep_every_configuration_the_first_given_to_the_lookup_table(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices

    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32), _copy_of_the_kernel(1))
    [choice] = launched_choices()
    assert choice.config["XBLOCK"] == 1 and [config["XBLOCK"] for config in choice.other_configs] == [32]
    assert lookup_table([choice]) == {choice.source_hash: choice.config}
    assert KernelChoice.from_plain(choice.to_plain()) == choice


def test_a_kernel_whose_copies_ran_otherwise_is_named_with_all_its_configurations(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices

    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32))
    [recorded] = launched_choices()
    graphs_holding(_copy_of_the_kernel(1))  # the replay: one copy per source, the first configuration
    outcome = compare([recorded], launched_choices())
    assert outcome["same"] == [] and outcome["other"] == []
    assert outcome["several"] == [
        "triton_per_fused_add_rms_norm_0: XBLOCK=1,num_warps=2,num_stages=1 here, "
        "XBLOCK=1,num_warps=2,num_stages=1 and XBLOCK=32,num_warps=2,num_stages=1 recorded"
    ]


def test_a_bundle_from_before_other_configs_reads_as_one_configuration_a_kernel():
    plain = {"kernel": "k", "source_hash": KEY, "config": GOOD, "origin": "timed"}
    assert KernelChoice.from_plain(plain).other_configs == []
