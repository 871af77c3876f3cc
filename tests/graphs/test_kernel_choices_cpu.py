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
# A process whose kernels came back from Inductor's compile workers holds one copy of a kernel per
# compiled graph, each configured on its own: on an H100 one float32 recording ran the layer-0
# copy of a norm with XBLOCK=1 and the layer-1 copy with XBLOCK=32. Real CachingAutotuner objects,
# built without a GPU, bound by compiled graphs' modules (an entry point `call`, code in a file)
# in Inductor's real code cache. (test_kernel_copies_cpu.py runs real Inductor graphs.)

SOURCE = "def triton_per_fused_add_rms_norm_0(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):\n    pass\n"
NAME = "triton_per_fused_add_rms_norm_0"


def _copy_of_the_kernel(xblock: int):
    from types import SimpleNamespace

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, Config

    autotuner = object.__new__(CachingAutotuner)
    autotuner.fn = SimpleNamespace(src=SOURCE, __name__=NAME)
    autotuner.size_hints = {"x": 128, "r0_": 128}
    autotuner.launchers = [SimpleNamespace(config=Config({"XBLOCK": xblock}, num_warps=2, num_stages=1))]
    autotuner.autotune_cache_info = {"autotune_cache_state": "hit"}
    return autotuner


def _graph_code(number: int) -> str:
    """A compiled graph's code as Inductor writes it: comments naming its cache folder and compile
    order, then its own code."""
    return (f"# AOT ID: ['{number}_inference']\n# kernel path: /tmp/torchinductor_x/ab/c{number}.py\n"
            f"{NAME} = async_compile.triton('{NAME}', '...')\ndef call(args):\n    return {number}\n")


@pytest.fixture
def graphs_holding(monkeypatch, tmp_path):
    """Put each copy in a compiled graph's module of its own, in load order (graph N's code is
    `_graph_code(N)`, or graph 0's where `same_code`)."""
    from types import ModuleType

    from torch._inductor.codecache import PyCodeCache

    def load(*copies, same_code=False):
        modules = []
        for number, autotuner in enumerate(copies):
            module = ModuleType(f"graph_{number}")
            path = tmp_path / f"load{len(list(tmp_path.iterdir()))}.py"
            path.write_text(_graph_code(0 if same_code else number))
            module.__file__ = str(path)
            exec(compile("def call(args):\n    return args\n", str(path), "exec"), module.__dict__)
            setattr(module, NAME, autotuner)
            modules.append(module)
        monkeypatch.setattr(PyCodeCache, "modules", modules)
        return modules
    return load


def _digest(number: int) -> str:
    from tracekit.graphs.kernel_choices import graph_digest

    return graph_digest(_graph_code(number))


def test_a_graph_is_keyed_by_its_code_not_its_comments():
    from tracekit.graphs.kernel_choices import graph_digest

    code = _graph_code(1)
    elsewhere = code.replace("/tmp/torchinductor_x/ab/", "/root/.cache/vllm/torch_compile_cache/inductor/zz/")
    later = code.replace("'1_inference'", "'7_inference'")
    assert graph_digest(code) == graph_digest(elsewhere) == graph_digest(later) == graph_digest(code + "\n\n")
    assert graph_digest(code) != graph_digest(code.replace("return 1", "return 2")) == _digest(2)


def test_copies_that_ran_alike_record_one_configuration_and_each_copy(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices, ran_apart

    graphs_holding(_copy_of_the_kernel(8), _copy_of_the_kernel(8))
    [choice] = launched_choices()
    assert choice.config == {"XBLOCK": 8, "num_warps": 2, "num_stages": 1} and choice.other_configs == []
    assert sorted((copy.graph, copy.binding, copy.config["XBLOCK"]) for copy in choice.copies) == sorted(
        [(_digest(0), NAME, 8), (_digest(1), NAME, 8)])
    assert not ran_apart(choice)


def test_copies_that_ran_otherwise_keep_every_configuration_each_under_its_graph(graphs_holding):
    from tracekit.graphs.kernel_choices import copy_table, launched_choices, ran_apart

    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32), _copy_of_the_kernel(1))
    [choice] = launched_choices()
    assert choice.config["XBLOCK"] == 1 and [config["XBLOCK"] for config in choice.other_configs] == [32]
    assert ran_apart(choice) and lookup_table([choice]) == {choice.source_hash: choice.config}
    table, refused = copy_table([choice])
    assert {key: config["XBLOCK"] for key, config in table.items()} == {
        (_digest(0), NAME): 1, (_digest(1), NAME): 32, (_digest(2), NAME): 1}
    assert refused == []
    assert KernelChoice.from_plain(choice.to_plain()) == choice


def test_a_graph_module_whose_file_is_gone_keys_no_copy(graphs_holding):
    from pathlib import Path

    from tracekit.graphs.kernel_choices import launched_choices

    first, second = graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32))
    second.__file__ = str(Path(second.__file__).with_name("gone.py"))
    [choice] = launched_choices()
    assert [copy.graph for copy in choice.copies] == [_digest(0)] and choice.other_configs
    assert not first.__file__.endswith("gone.py")


def test_each_copy_is_held_against_the_copy_of_its_own_graph(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices

    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32))
    [recorded] = launched_choices()
    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32))  # the replay gave each copy its own
    assert compare([recorded], launched_choices())["same"] == [NAME]
    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(1))  # graph 1's copy kept the table's
    outcome = compare([recorded], launched_choices())
    assert outcome["same"] == [] and outcome["several"] == []
    assert outcome["other"] == [f"{NAME} in graph {_digest(1)[:12]}: XBLOCK=1,num_warps=2,num_stages=1 here, "
                                "XBLOCK=32,num_warps=2,num_stages=1 recorded"]


def test_a_copy_of_a_graph_the_recording_did_not_hold_is_held_against_the_one_configuration(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices

    graphs_holding(_copy_of_the_kernel(8))
    [recorded] = launched_choices()
    graphs_holding(_copy_of_the_kernel(8), _copy_of_the_kernel(8))
    assert compare([recorded], launched_choices())["same"] == [NAME]


def test_a_kernel_whose_copies_cannot_be_told_apart_is_named_with_all_its_configurations(graphs_holding):
    from tracekit.graphs.kernel_choices import copy_table, launched_choices

    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32), same_code=True)  # identical graphs
    [recorded] = launched_choices()
    assert copy_table([recorded]) == ({}, [])
    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(1), same_code=True)
    outcome = compare([recorded], launched_choices())
    assert outcome["same"] == [] and outcome["other"] == []
    assert outcome["several"] == [
        f"{NAME}: XBLOCK=1,num_warps=2,num_stages=1 here, "
        "XBLOCK=1,num_warps=2,num_stages=1 and XBLOCK=32,num_warps=2,num_stages=1 recorded"
    ]
    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32))  # a graph the recording did not hold
    assert compare([recorded], launched_choices())["several"]


def test_a_bundle_from_before_copies_is_held_kernel_by_kernel(graphs_holding):
    from tracekit.graphs.kernel_choices import launched_choices

    graphs_holding(_copy_of_the_kernel(1), _copy_of_the_kernel(32))
    [here] = launched_choices()
    before = KernelChoice(NAME, here.source_hash, {"XBLOCK": 1, "num_warps": 2, "num_stages": 1})
    assert compare([before], [here])["several"] and compare([before], [here])["same"] == []


def test_a_bundle_from_before_other_configs_reads_as_one_configuration_a_kernel():
    plain = {"kernel": "k", "source_hash": KEY, "config": GOOD, "origin": "timed"}
    assert KernelChoice.from_plain(plain).other_configs == [] and KernelChoice.from_plain(plain).copies == []


def test_a_copy_a_newer_tracekit_wrote_keeps_what_it_added():
    plain = {"kernel": "k", "source_hash": KEY, "config": GOOD,
             "copies": [{"graph": "1" * 64, "binding": "k", "config": GOOD, "launch_order": 3}]}
    choice = KernelChoice.from_plain(plain)
    assert choice.copies[0].extras == {"launch_order": 3} and choice.to_plain() == {
        **plain, "origin": "", "other_configs": []}


@pytest.mark.parametrize("graph, binding, config", [
    ("not-a-sha256", "k", GOOD),
    ("1" * 64, "k; import os", GOOD),
    ("1" * 64, "", GOOD),
    ("1" * 64, "k", {**GOOD, "XBLOCK": 12}),
])
def test_a_copy_no_replay_can_give_is_refused_and_named(graph, binding, config):
    from tracekit.format.schema import KernelCopy
    from tracekit.graphs.kernel_choices import copy_table

    choice = KernelChoice("k", KEY, GOOD, copies=[KernelCopy(graph, binding, config),
                                                  KernelCopy("2" * 64, "k", {**GOOD, "XBLOCK": 16})])
    table, refused = copy_table([choice])
    assert table == {("2" * 64, "k"): {**GOOD, "XBLOCK": 16}}
    assert len(refused) == 1 and refused[0].startswith("k in graph ")


# -- a suite's engines ------------------------------------------------------------------------------


def _choice(xblock, *copies):
    from tracekit.format.schema import KernelCopy

    config = {**GOOD, "XBLOCK": xblock}
    return KernelChoice("k", KEY, config, copies=[KernelCopy(graph * 64, "k", {**GOOD, "XBLOCK": x})
                                                  for graph, x in copies])


@pytest.mark.parametrize("first, second, agree", [
    (_choice(1), _choice(1), True),
    (_choice(1), _choice(32), False),
    (_choice(1, ("a", 1), ("b", 32)), _choice(1, ("a", 1), ("b", 32)), True),
    (_choice(1, ("a", 1), ("b", 32)), _choice(1, ("a", 1)), True),  # graph b not run by the other
    (_choice(1, ("a", 1), ("b", 32)), _choice(1, ("a", 1), ("b", 1)), False),  # graph b's copy otherwise
    (_choice(1, ("a", 1), ("b", 32)), _choice(1), False),  # the other says nothing of its copies
    (_choice(1, ("a", 1)), _choice(1), True),
])
def test_bundles_share_an_engine_only_where_every_copy_would_run_as_each_recorded(first, second, agree):
    from tracekit.graphs.kernel_choices import merged_if_consistent, ran_apart

    for one, other in ((first, second), (second, first)):
        kept = {}
        assert merged_if_consistent(kept, [one])
        assert merged_if_consistent(kept, [other]) is agree
        if agree:
            merged = kept[KEY]
            assert {(copy.graph, copy.config["XBLOCK"]) for copy in merged.copies} == {
                (copy.graph, copy.config["XBLOCK"]) for copy in one.copies + other.copies}
            assert ran_apart(merged) == (ran_apart(one) or ran_apart(other))
        else:
            assert kept == {KEY: one}
