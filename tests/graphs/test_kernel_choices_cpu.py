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
