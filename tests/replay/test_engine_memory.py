"""A replay engine whose KV cache size is given asks vLLM for no more than the card has free: vLLM
refuses to start below `gpu_memory_utilization` x total free, a budget a given cache size leaves
unused, so a replay beside another process on the card was refused (vLLM 0.34, H100 lanes)."""

from tracekit.integrations.vllm.engines.build import within_free_memory

GIB = 1 << 30


def test_a_given_cache_size_asks_for_what_is_free():
    args = within_free_memory({"num_gpu_blocks_override": 128}, (30 * GIB, 80 * GIB))
    assert args == {"num_gpu_blocks_override": 128, "gpu_memory_utilization": 0.275}
    assert 80 * GIB * args["gpu_memory_utilization"] <= 30 * GIB - 8 * GIB  # a tenth of the card to spare


def test_a_given_cache_size_on_an_idle_card_asks_no_more_than_vllms_default():
    """An H200 seen with 137.6 of 139.8 GiB free: asking for all of it (0.984) was refused when
    vLLM's own reading, moments later, found 136.9 GiB (its engine process's context, replays
    starting beside it)."""
    args = within_free_memory({"kv_cache_memory_bytes": 64 << 20}, (int(137.6 * GIB), int(139.8 * GIB)))
    assert args["gpu_memory_utilization"] == 0.884
    assert int(139.8 * GIB) * args["gpu_memory_utilization"] < 136.9 * GIB
    assert within_free_memory({"kv_cache_memory_bytes": 64 << 20}, (80 * GIB, 80 * GIB))["gpu_memory_utilization"] == 0.9


def test_the_users_utilization_and_a_measured_cache_are_left_as_they_are():
    given = {"num_gpu_blocks_override": 128, "gpu_memory_utilization": 0.5}
    assert within_free_memory(given, (1 * GIB, 80 * GIB)) == given
    measured = {"num_gpu_blocks_override": None, "dtype": "bfloat16"}
    assert within_free_memory(measured, (30 * GIB, 80 * GIB)) == measured
    assert within_free_memory({"num_gpu_blocks_override": 8}, (0, 80 * GIB)) == {"num_gpu_blocks_override": 8}
    assert within_free_memory({"num_gpu_blocks_override": 8}, (1 << 20, 80 * GIB)) == {"num_gpu_blocks_override": 8}


def test_beside_a_server_holding_most_of_the_card_half_of_what_is_free_is_asked():
    """An H100 whose other process (a `vllm serve` at its default 0.92) left 6.4 GiB: a tenth of
    the card to spare would leave nothing to ask for, and the replay was refused."""
    args = within_free_memory({"num_gpu_blocks_override": 8}, (int(6.4 * GIB), 80 * GIB))
    assert args["gpu_memory_utilization"] == 0.039  # floored: vLLM asks for ceil(total x it)
    assert 80 * GIB * args["gpu_memory_utilization"] <= 3.2 * GIB
