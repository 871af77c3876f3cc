"""Copies of one kernel source, each bound by a compiled graph of its own and given a
configuration of its own, with real Inductor on this CPU: two graphs that share a reduction
kernel (kernel_copies_script.py) compiled to Triton and run in Triton's interpreter
(tests/harness/triton_on_cpu.py), where, as on a GPU whose kernels Inductor builds in its own
process, both graphs bind one `CachingAutotuner`. The GPU runs the same script with its kernels
built in the process and in compile workers (test_gpu_kernel_choices.py). One process, ~40 s."""

import kernel_copies_checks as copies
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    return copies.run_script(tmp_path_factory.mktemp("kernel-copies"), cpu=True)


def test_two_graphs_bind_copies_of_one_kernel_source_each_recorded_under_its_graph(ran):
    copies.check_each_copy_recorded_under_its_graph(ran)
    assert len({entry["object"] for entry in copies.copies_loaded(ran)}) == 1  # one module per source, shared


def test_each_copy_runs_its_own_configuration_bit_for_bit_as_that_configuration_does(ran):
    copies.check_each_copy_runs_its_own_configuration(ran)


def test_a_graph_keeps_its_key_in_another_cache_folder_and_compile_order(ran):
    copies.check_graph_keys_kept_across_cache_folders(ran)
