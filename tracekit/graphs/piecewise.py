"""A piecewise graph backend for `torch.compile`: the forward is split at named ops (attention,
as vLLM does), and every other piece is compiled for the recorded sizes and captured as one graph
per capture size, then replayed.

tracekit owns this backend rather than relying on vLLM's, so that a replay captures exactly the
recorded capture-size table and so that each piece can be run both ways for the divergence report
(`tracekit.graphs.divergence`). docs/GRAPHS.md ("The piecewise backend") gives its steps and why
a splitting op must write into a buffer the piece before it allocated.
"""

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from tracekit.errors import TracekitError, UsageError
from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import DeviceBackend
from tracekit.graphs.piece_compilers import PieceCompiler, eager_pieces, inductor_pieces
from tracekit.graphs.piece_split import PieceSpec, split_at_ops


class GraphInputMoved(TracekitError):
    """A replay got an input at another address than its capture: the graph would read stale
    memory. Raised only in debug mode."""


PIECE_COMPILERS: dict[str, PieceCompiler] = {"eager": eager_pieces, "inductor": inductor_pieces}


@dataclass
class PiecewiseCounters:
    """What the backend did, per (piece index, size), so tests and reports can check it."""

    compiled: list[tuple[int, int | None]] = field(default_factory=list)
    warmups: Counter = field(default_factory=Counter)
    captured: list[tuple[int, int]] = field(default_factory=list)
    replays: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    captures_with_gc_suppressed: int = 0

    def to_plain(self) -> dict[str, Any]:
        return {
            "compiled": [list(key) for key in self.compiled],
            "warmups": _counter_rows(self.warmups),
            "captured": [list(key) for key in self.captured],
            "replays": _counter_rows(self.replays),
            "fallbacks": _counter_rows(self.fallbacks),
            "captures_with_gc_suppressed": self.captures_with_gc_suppressed,
        }


def _counter_rows(counter: Counter) -> list[list[int]]:
    rows = [[piece, size, count] for (piece, size), count in counter.items()]
    return sorted(rows, key=lambda row: (row[0], -1 if row[1] is None else row[1]))


class PiecewiseGraphBackend:
    """`torch.compile(model, backend=PiecewiseGraphBackend(table, splitting_ops, device))`.

    The batch size is read from the graph's first symbolic-size input (mark the token dimension
    dynamic, as vLLM does); a graph without one runs every piece in its general compiled form.
    """

    def __init__(
        self,
        table: CaptureTable,
        splitting_ops: Sequence[str],
        device: DeviceBackend,
        compiler: str | PieceCompiler = "eager",
    ):
        self.table = table
        self.splitting_ops = list(splitting_ops)
        self.device = device
        self.compiler = PIECE_COMPILERS[compiler] if isinstance(compiler, str) else compiler
        self.pool = None
        if table.captures_pieces and table.capture_sizes:
            device.require_graphs()
            self.pool = device.graph_pool_handle()
        self.counters = PiecewiseCounters()
        self.forwards: list[SplitForward] = []
        # Set by `tracekit.graphs.divergence.probe` for the forwards it watches.
        self.probe: Any = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            raise UsageError("PiecewiseGraphBackend is a torch.compile backend: use it through it")
        split_gm, specs = split_at_ops(gm, self.splitting_ops)
        fake_inputs = [
            fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
            for value in example_inputs
        ]
        with fake_mode:
            piece_inputs = _PieceInputs(split_gm).collect(fake_inputs)
        size_index = next(
            (i for i, value in enumerate(example_inputs) if isinstance(value, torch.SymInt)), None
        )
        forward = SplitForward(split_gm, specs, size_index)
        captured = [spec for spec in specs if not spec.is_splitting_op]
        for position, spec in enumerate(captured):
            runner = PieceRunner(
                self,
                forward,
                spec,
                general=self.compiler(spec, piece_inputs[spec.name], None),
                is_first=position == 0,
                is_last=position == len(captured) - 1,
            )
            self.counters.compiled.append((spec.index, None))
            # Bypasses nn.Module's attribute checks: the split module calls it as a submodule.
            split_gm.__dict__[spec.name] = runner
        self.forwards.append(forward)
        return forward

    def size_entries(self) -> dict[int, "SizeEntry"]:
        """What a new piece prepares per size: compile and/or capture as the table says."""
        capture = set(self.table.capture_sizes) if self.table.captures_pieces else set()
        compile_ = set(self.table.compile_sizes)
        return {
            size: SizeEntry(compile=size in compile_, capture=size in capture)
            for size in sorted(capture | compile_)
        }


class SplitForward:
    """The callable the backend hands to dynamo: notes the batch size, then runs the pieces."""

    def __init__(self, split_gm: fx.GraphModule, specs: list[PieceSpec], size_index: int | None):
        self.split_gm = split_gm
        self.specs = specs
        self.size_index = size_index
        self.size: int | None = None

    def __call__(self, *args: Any) -> Any:
        self.size = None if self.size_index is None else int(args[self.size_index])
        return self.split_gm(*args)


@dataclass
class SizeEntry:
    compile: bool
    capture: bool
    runnable: Callable | None = None
    warmups_done: int = 0
    graph: Any = None
    output: Any = None
    input_addresses: list[int] | None = None


class PieceRunner:
    """Stands in for one piece: the general compiled piece for other sizes; for a table size, the
    size-compiled piece through its warm-ups, then its graph."""

    def __init__(
        self,
        owner: PiecewiseGraphBackend,
        forward: SplitForward,
        spec: PieceSpec,
        general: Callable,
        is_first: bool,
        is_last: bool,
    ):
        self.owner, self.forward, self.spec = owner, forward, spec
        self.general = general
        self.is_first, self.is_last = is_first, is_last
        self.entries = owner.size_entries()
        # How the last call ran: general, compiled, warmup, capture or replay.
        self.last_path = ""

    def __call__(self, *args: Any) -> Any:
        probe = self.owner.probe
        if probe is None:
            return self._dispatch(args)
        before = probe.snapshot(args)
        output = self._dispatch(args)
        probe.observe(self, before, output)
        return output

    def _dispatch(self, args: tuple) -> Any:
        counters, size = self.owner.counters, self.forward.size
        key = (self.spec.index, size)
        entry = self.entries.get(size)
        if entry is None:
            counters.fallbacks[key] += 1
            self.last_path = "general"
            return self.general(*args)
        if entry.compile and entry.runnable is None:
            entry.runnable = self.owner.compiler(self.spec, args, size)
            counters.compiled.append(key)
        runnable = entry.runnable or self.general
        if not entry.capture:
            self.last_path = "compiled"
            return runnable(*args)
        if entry.graph is None and entry.warmups_done < self.owner.table.num_warmups:
            entry.warmups_done += 1
            counters.warmups[key] += 1
            self.last_path = "warmup"
            return runnable(*args)
        if entry.graph is None:
            self.last_path = "capture"
            return self._capture(entry, runnable, args)
        if self.owner.table.debug:
            self._check_addresses(entry, args)
        entry.graph.replay()
        counters.replays[key] += 1
        self.last_path = "replay"
        return entry.output

    def _capture(self, entry: SizeEntry, runnable: Callable, args: tuple) -> Any:
        device, counters = self.owner.device, self.owner.counters
        entry.input_addresses = _addresses(args)
        graph = device.new_graph()
        with contextlib.ExitStack() as stack:
            if not self.is_first:
                stack.enter_context(device.gc_suppressed())
                counters.captures_with_gc_suppressed += 1
            with device.graph_capture(graph, pool=self.owner.pool):
                output = runnable(*args)
                if self.is_last:
                    # Nothing captured later reads the last piece's output, so its memory can go
                    # back to the pool at once.
                    output = weak_alias(output)
        entry.output = weak_alias(output)
        entry.graph = graph
        counters.captured.append((self.spec.index, self.forward.size))
        # A capture only records kernels; running them once makes this forward's output real.
        graph.replay()
        # The strong output keeps its pool memory alive while later pieces of this forward are
        # captured; replays return the weak alias.
        return output

    def _check_addresses(self, entry: SizeEntry, args: tuple) -> None:
        now = _addresses(args)
        moved = [i for i, (was, is_) in enumerate(zip(entry.input_addresses, now)) if was != is_]
        if moved or len(now) != len(entry.input_addresses):
            raise GraphInputMoved(
                f"piece {self.spec.name} (size {self.forward.size}): tensor inputs {moved} are "
                f"not where the capture saw them; the graph would read stale memory"
            )


def _addresses(args: Sequence[Any]) -> list[int]:
    return [arg.data_ptr() for arg in args if isinstance(arg, torch.Tensor)]


def weak_alias(output: Any) -> Any:
    """The same tensors (through tuples and lists), as views that do not own their memory."""
    if isinstance(output, torch.Tensor):
        storage = output.untyped_storage()
        unowned = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), output.device, storage.nbytes()
        )
        alias = torch.empty(0, dtype=output.dtype, device=output.device)
        return alias.set_(unowned, output.storage_offset(), output.size(), output.stride())
    if isinstance(output, (tuple, list)):
        return type(output)(weak_alias(item) for item in output)
    return output


class _PieceInputs(fx.Interpreter):
    """Runs the split module on fake inputs and keeps the arguments each piece receives."""

    def __init__(self, split_gm: fx.GraphModule):
        super().__init__(split_gm)
        self.inputs: dict[str, tuple] = {}

    def collect(self, example_inputs: Sequence[Any]) -> dict[str, tuple]:
        self.run(*example_inputs)
        return self.inputs

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        self.inputs[target] = args
        return super().call_module(target, args, kwargs)
