"""The device seam on a machine without graphs: graph work is refused with a reason, never faked;
timing, the capture table and the replay modes still work where they can."""

import importlib.util
import time

import pytest
import torch
from toy_transformer import ToyTransformer

from tracekit.errors import EXIT_CANNOT_RUN_HERE, BundleError, CannotRunHere, UsageError
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import default_device, get_device_backend
from tracekit.graphs.modes import expand_modes, measure_mode
from tracekit.graphs.oneshot import capture_and_time, first_tensor
from tracekit.graphs.timing import HOST_CLOCK, RegionTimer, latency_summary, time_callable

CPU = get_device_backend("cpu")


def test_cpu_refuses_every_graph_operation_with_its_reason():
    assert not CPU.has_graphs
    assert "cpu has no graph capture" in CPU.unavailable_reason
    for operation in (
        CPU.new_graph,
        CPU.graph_pool_handle,
        CPU.new_stream,
        lambda: CPU.graph_capture(None),
        lambda: CPU.timing_event(in_graph=True),
    ):
        with pytest.raises(CannotRunHere) as refused:
            operation()
        assert refused.value.exit_code == EXIT_CANNOT_RUN_HERE


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_says_so():
    backend = get_device_backend("cuda:0")
    assert not backend.has_graphs and "is_available() is False" in backend.unavailable_reason
    assert default_device() == "cpu" or importlib.util.find_spec("torch_npu")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu present")
def test_npu_without_torch_npu_says_so():
    assert "torch_npu" in get_device_backend("npu").unavailable_reason


def test_one_shot_capture_is_refused_on_cpu():
    with pytest.raises(CannotRunHere):
        capture_and_time(lambda: torch.zeros(1), [], CPU, iters=1, samples=1)


def test_latency_summary_follows_the_forward_bench():
    times = [10.0, 12.0, 11.0, 20.0, 21.0, 22.0]
    summary = latency_summary(times, samples=2, timer="t")
    assert summary["median"] == 16.0 and summary["min"] == 10.0 and summary["count"] == 6
    # Sample medians 11 and 21, relative to the overall median.
    assert summary["sample_spread_pct"] == pytest.approx(100 * 10 / 16)
    assert summary["p90"] == pytest.approx(21.5)
    with pytest.raises(ValueError):
        latency_summary(times, samples=4, timer="t")


def test_time_callable_on_cpu_uses_perf_counter_and_runs_before_each_call():
    calls = []
    summary = time_callable(
        lambda: calls.append("fn"), iters=3, samples=2, backend=CPU, warmup_s=0.0,
        before=lambda: calls.append("before"),
    )
    assert summary["timer"] == "perf_counter" and summary["count"] == 6
    assert calls[-12:] == ["before", "fn"] * 6


def test_capture_table_round_trips_and_rejects_bad_data():
    table = CaptureTable(mode="piecewise", capture_sizes=(8, 2, 4, 4), compile_sizes=(8,),
                         num_warmups=1)
    assert table.capture_sizes == (2, 4, 8) and table.captures_pieces
    assert CaptureTable.from_plain(table.to_plain()) == table
    assert not CaptureTable(mode="full", capture_sizes=(2,)).captures_pieces
    for bad in (
        {"mode": "sometimes", "capture_sizes": []},
        {"mode": "piecewise", "capture_sizes": [0]},
        {"mode": "piecewise", "capture_sizes": [True]},
        {"mode": "piecewise", "capture_sizes": [2], "num_warmups": -1},
        {"mode": "piecewise", "capture_sizes": [2], "colour": "red"},
        {"capture_sizes": [2]},
    ):
        with pytest.raises(BundleError):
            CaptureTable.from_plain(bad)


def test_all_modes_on_cpu_run_eager_and_compiled_and_mark_graph_modes_unavailable():
    torch.manual_seed(0)
    model = ToyTransformer(hidden=64, layers=1, slots=32)
    ids, positions = torch.randint(0, 512, (6,)), torch.arange(6)
    with torch.no_grad():
        expected = model(ids, positions)
        compiled = torch.compile(model, backend="eager")
        forwards = {
            "eager": lambda: model(ids, positions),
            "compiled": lambda: compiled(ids, positions),
            # (the replay engine's other forms of its model call: here the compiled forward too)
            "compiled-no-graph": lambda: compiled(ids, positions),
            "vllm-piecewise": lambda: compiled(ids, positions),
            "graph": lambda: model(ids, positions),
            "piecewise": lambda: model(ids, positions),
        }
        reports = {
            mode: measure_mode(mode, forwards[mode], model.kv_caches(), expected, CPU,
                               iters=2, samples=2, warmup_s=0.0)
            for mode in expand_modes("all")
        }
    for mode in ("eager", "compiled", "compiled-no-graph", "vllm-piecewise"):
        assert reports[mode]["available"] and reports[mode]["vs_recorded"]["bit_exact"], mode
        assert reports[mode]["latency_us"]["count"] == 4 and reports[mode]["deterministic"]
    for mode in ("graph", "piecewise"):
        assert reports[mode] == {"mode": mode, "available": False,
                                 "reason": CPU.unavailable_reason}
    with pytest.raises(UsageError):
        expand_modes("turbo")
    assert expand_modes("eager, compiled,eager") == ["eager", "compiled"]
    unrecorded = measure_mode("eager", forwards["eager"], [], None, CPU, 1, 1, warmup_s=0.0)
    assert unrecorded["available"] and unrecorded["vs_recorded"] is None


def test_first_tensor_finds_the_leading_tensor():
    t = torch.ones(2)
    assert first_tensor(((t, 1), 2)) is t and first_tensor({"logits": t}) is t
    with pytest.raises(TypeError):
        first_tensor(3)


def test_region_timer_on_cpu_times_by_the_host_clock_and_says_so():
    timer = RegionTimer(CPU)
    time.sleep(0.002)
    measured = timer.stop()
    assert measured.timer == HOST_CLOCK and measured.us >= 2000 and measured.host_us == measured.us
    assert not CPU.can_spin
    summary = time_callable(lambda: None, iters=2, samples=2, backend=CPU, warmup_s=0.0)
    assert summary["runs_with_host_gaps"] == 0 and summary["host_issue_us"] >= 0
