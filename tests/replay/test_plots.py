"""`--plot`: latency distributions against the recorded time and, for a replay that is not
bit-exact, the relative error per layer; refused with the install command where matplotlib is
missing. The results drawn are real `ReplayResult`s built from known numbers (no engine needed
to draw); `tests/e2e/test_replay_suite.py` draws real replays."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.graphs.timing import latency_summary
from tracekit.replay.checks import CheckedItem
from tracekit.replay.result import ReplayResult
from tracekit.replay.suite import record_of

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYER_ERRORS = [("model.layers.0.self_attn.attn", 0.0), ("model.layers.1.self_attn.attn", 2e-7)]


def result(bit_exact: bool) -> ReplayResult:
    kv = [CheckedItem(f"kv_written/{name}", error == 0.0, True, {"relative_rms": error}) for name, error in LAYER_ERRORS]
    hidden = CheckedItem("hidden_states", bit_exact, True, {"relative_rms": 0.0 if bit_exact else 3e-7})
    runs = [1500.0, 1550.0, 1600.0, 1700.0]
    return ReplayResult(
        bundle="step.zst", step_index=1, trigger="steps 1", reference_mode="eager",
        checks=[*(kv if not bit_exact else []), hidden],
        modes={"eager": {"mode": "eager", "available": True, "latency_us": latency_summary(runs, 2, "perf_counter")},
               "graph": {"mode": "graph", "available": False, "reason": "no graphs on CPU"}},
        recorded_timing={"forward_us": 1750.0}, tolerance=1e-6,
    )


def test_layer_errors_come_in_forward_order_from_the_checks():
    from tracekit.replay.plots import layer_errors

    assert layer_errors(record_of(result(bit_exact=False), "step").to_plain()) == [
        (name.removeprefix("kv_written/"), error) for name, error in LAYER_ERRORS
    ] + [("hidden_states", 3e-7)]


@pytest.mark.parametrize("bundles", [1, 3])
def test_plot_is_a_png(tmp_path, bundles):
    pytest.importorskip("matplotlib")
    from tracekit.replay.plots import plot_records

    records = [record_of(result(bit_exact=i != 0), f"step{i}").to_plain() for i in range(bundles)]
    path = plot_records(records, tmp_path / "replay.png")
    assert Path(path).read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in tmp_path.iterdir()] == ["replay.png"]  # no partial file left behind


def test_layer_panel_draws_the_given_errors():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from tracekit.replay.plots import draw_layer_errors

    axis = Figure().subplots()
    draw_layer_errors(axis, {"step1": LAYER_ERRORS})
    [line] = axis.get_lines()
    assert list(line.get_ydata()) == [error for _, error in LAYER_ERRORS]
    assert [label.get_text() for label in axis.get_xticklabels()] == ["layers.0.self_attn.attn", "layers.1.self_attn.attn"]


def test_without_matplotlib_plot_is_refused_before_any_engine(tmp_path):
    hide_matplotlib = (
        "import sys; sys.modules['matplotlib'] = None; from tracekit.cli import main; "
        f"main(['replay', {str(SAMPLE)!r}, '--plot', {str(tmp_path / 'x.png')!r}])"
    )
    finished = subprocess.run([sys.executable, "-c", hide_matplotlib], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert finished.returncode == 3, finished.stderr
    [line] = [line for line in finished.stderr.splitlines() if line.startswith("tracekit: error:")]
    assert "matplotlib" in line and "pip install" in line
    assert not any(tmp_path.iterdir())
