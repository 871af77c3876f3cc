"""`tracekit replay --plot`: the figures people would rather look at than read (docs/GUIDE.md,
"Replaying"). Drawn from the records `--json` writes (`SuiteRecord.to_plain()`), so that a replay
that ran in a child process is drawn by the command's own.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracekit.errors import CannotRunHere, UsageError
from tracekit.outputs import atomic_path

Record = dict[str, Any]  # one bundle's JSON record

FORMATS = ("png", "svg", "pdf")
INSTALL = "pip install 'matplotlib>=3.7'  (or: pip install 'tracekit[plot]')"
# Layer series drawn at most (the first bundles that are not bit-exact), to stay readable.
MAX_LAYER_SERIES = 8


def require_matplotlib(path: str | Path) -> None:
    """Refuse --plot early: an unknown file type (exit 2), matplotlib missing (exit 3)."""
    if Path(path).suffix.lstrip(".").lower() not in FORMATS:
        raise UsageError(f"--plot {path}: name a .png, .svg or .pdf file")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CannotRunHere(f"--plot needs matplotlib, which is not installed here: {INSTALL}") from None


def layer_errors(record: Record) -> list[tuple[str, float]]:
    """(layer name, relative RMS) in forward order from the replay's checks: the KV written per
    layer, then hidden states and logits."""
    pairs = []
    for item in record.get("checks", []):
        relative, name = item.get("relative_rms"), item.get("item", "")
        if relative is not None and (name.startswith("kv_written/") or name in ("hidden_states", "logits")):
            pairs.append((name.removeprefix("kv_written/"), float(relative)))
    return pairs


def plot_records(records: Sequence[Record], path: str | Path) -> str:
    """Draw the replays of `records` into `path` (written atomically); returns the path."""
    from matplotlib.figure import Figure

    replayed = [record for record in records if "checks" in record]
    parted = [record for record in replayed if not record.get("bit_exact", True)]
    layer_series = {_name(record): pairs for record in parted if (pairs := layer_errors(record))}
    rows = 2 if layer_series else 1
    boxes = sum(len(_timed(record)) for record in replayed)
    figure = Figure(figsize=(max(7.0, 1.2 * boxes), 4.5 * rows), layout="constrained")
    axes = figure.subplots(rows, 1, squeeze=False)[:, 0]
    draw_latencies(axes[0], replayed)
    if layer_series:
        draw_layer_errors(axes[1], dict(list(layer_series.items())[:MAX_LAYER_SERIES]))
    with atomic_path(path) as partial:
        figure.savefig(partial, format=Path(path).suffix.lstrip(".").lower(), dpi=110)
    return str(path)


def _name(record: Record) -> str:
    return record.get("name") or Path(record["bundle"]).stem


def _timed(record: Record) -> list[tuple[str, dict[str, Any]]]:
    return [(mode, report) for mode, report in record.get("modes", {}).items() if report.get("available")]


def draw_latencies(axis: Any, records: Sequence[Record]) -> None:
    """Box plots of each timed mode's runs; a single bundle in ms against its recorded time,
    several as multiples of their own recorded times."""
    relative = len(records) > 1
    boxes, labels = [], []
    for record in records:
        recorded = record.get("recorded_forward_us")
        for mode, report in _timed(record):
            runs = report["latency_us"]["samples_us"]
            if relative:
                if not recorded:
                    continue
                boxes.append([run / recorded for run in runs])
                labels.append(f"{_name(record)}\n{mode}")
            else:
                boxes.append([run / 1000 for run in runs])
                labels.append(mode)
    if not boxes:
        axis.text(0.5, 0.5, "no timed forwards (--no-timing, or no mode available here)",
                  ha="center", va="center", transform=axis.transAxes)
        axis.set_axis_off()
        return
    axis.boxplot(boxes, showmeans=True)
    axis.set_xticks(range(1, len(labels) + 1), labels, rotation=30 if relative else 0, ha="right" if relative else "center",
                    fontsize="small")
    if relative:
        axis.set_yscale("log")
        axis.axhline(1.0, color="tab:red", linestyle="--", label="recorded in the engine")
        axis.set_ylabel("forward time / recorded")
        axis.set_title("replayed forward time relative to the recorded one")
    else:
        record = records[0]
        recorded = record.get("recorded_forward_us")
        if recorded:
            axis.axhline(recorded / 1000, color="tab:red", linestyle="--",
                         label=f"recorded in the engine ({recorded / 1000:.3f} ms)")
        axis.set_ylabel("forward time (ms)")
        axis.set_title(f"{_name(record)} step {record.get('step')}: forward time per mode")
    axis.legend(loc="best", fontsize="small")


def draw_layer_errors(axis: Any, series: dict[str, list[tuple[str, float]]]) -> None:
    """One line per bundle over its layers in forward order: relative RMS, log-scaled, with
    bit-exact layers (0) on the axis' linear band at the bottom."""
    smallest = min((error for pairs in series.values() for _, error in pairs if error > 0), default=1e-9)
    for label, pairs in series.items():
        axis.plot(range(len(pairs)), [error for _, error in pairs], marker="o", label=label)
    longest = max(series.values(), key=len)
    # `model.layers.3.self_attn.attn` -> `layers.3.self_attn.attn`: the shared prefix adds nothing
    axis.set_xticks(range(len(longest)), [name.removeprefix("model.") for name, _ in longest], rotation=30,
                    ha="right", fontsize="small")
    axis.set_yscale("symlog", linthresh=smallest / 10)
    axis.set_ylim(bottom=0)
    axis.set_ylabel("relative RMS vs recorded")
    axis.set_title("where the replay parts from the recording (0: bit-exact)")
    axis.legend(loc="best", fontsize="small")
