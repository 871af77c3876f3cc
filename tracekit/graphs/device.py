"""The device seam: everything the graph layer needs from a platform, named once per platform
(CUDA, Ascend NPUs through `torch_npu`), so that the rest of `tracekit.graphs` is written once. On
a machine without graphs every graph operation raises `CannotRunHere` with the reason
(docs/GRAPHS.md, "The device seam"): nothing is faked.
"""

import contextlib
import gc
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tracekit.errors import CannotRunHere


@dataclass(frozen=True)
class DeviceBackend:
    """One platform's graph and timing primitives; `module` is `torch.cuda`, `torch.npu` or None."""

    name: str
    # As given ("cuda:1"): `torch.device("npu")` only parses once torch_npu is imported.
    device: str
    module: ModuleType | None
    graph_class_name: str = ""
    # Whether timing events recorded during capture become nodes of the graph (CUDA's
    # `external=True`); where not, replays are timed by events around them instead.
    in_graph_timing: bool = False
    unavailable_reason: str | None = None

    @property
    def has_graphs(self) -> bool:
        return self.unavailable_reason is None

    @property
    def has_device_events(self) -> bool:
        return self.module is not None

    def require_graphs(self) -> None:
        """Raise `CannotRunHere` with the reason when this platform cannot capture graphs."""
        if self.unavailable_reason is not None:
            raise CannotRunHere(self.unavailable_reason)

    def new_graph(self) -> Any:
        self.require_graphs()
        return getattr(self.module, self.graph_class_name)()

    def graph_capture(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager:
        """The context in which the work issued on `stream` is recorded into `graph`."""
        self.require_graphs()
        return self.module.graph(graph, pool=pool, stream=stream)

    def graph_pool_handle(self) -> Any:
        """A memory pool that several graphs can share (pieces of one forward, say)."""
        self.require_graphs()
        return self.module.graph_pool_handle()

    def new_stream(self) -> Any:
        self.require_graphs()
        return self.module.Stream(device=self.device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        self.require_graphs()
        return self.module.stream(stream)

    def wait_for_current_stream(self, stream: Any) -> None:
        """Make `stream` start after the work already queued on the current stream."""
        stream.wait_stream(self.module.current_stream(self.device))

    def timing_event(self, in_graph: bool = False) -> Any:
        """A device event with timing; `in_graph` ones are recorded inside a capture."""
        if self.module is None:
            raise CannotRunHere(f"{self.name} has no device events; time it with perf_counter")
        if in_graph:
            self.require_graphs()
            return self.module.Event(enable_timing=True, external=True)
        return self.module.Event(enable_timing=True)

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize(self.device)

    @property
    def can_spin(self) -> bool:
        """Whether `spin` can hold this device's stream (CUDA's `_sleep`; not claimed elsewhere)."""
        return self.module is not None and hasattr(self.module, "_sleep")

    def spin(self, cycles: int) -> None:
        """Queue a kernel on the current stream that busy-waits `cycles` device clock cycles."""
        if not self.can_spin:
            raise CannotRunHere(f"{self.name} has no spin kernel")
        self.module._sleep(int(cycles))

    @contextlib.contextmanager
    def gc_suppressed(self) -> Iterator[None]:
        """Within it, the garbage collection and cache emptying that a capture starts with are
        skipped: capturing dozens of pieces in a row would otherwise collect every time."""
        saved_collect, saved_empty = gc.collect, self.module.empty_cache
        gc.collect = lambda generation=2: 0
        self.module.empty_cache = lambda: None
        try:
            yield
        finally:
            gc.collect, self.module.empty_cache = saved_collect, saved_empty


def get_device_backend(device: str | torch.device) -> DeviceBackend:
    """The backend for `device` ("cuda", "cuda:1", "npu", "cpu", or "auto" for the best here)."""
    device = str(device)
    if device == "auto":
        device = default_device()
    kind = device.split(":")[0]
    if kind == "cuda":
        return _cuda_backend(device)
    if kind == "npu":
        return _npu_backend(device)
    return _without_graphs(
        kind, device, f"graph modes need a CUDA or NPU device; {kind} has no graph capture"
    )


def default_device() -> str:
    """"cuda" where CUDA works, else "npu" where torch_npu is installed and sees a device, else
    "cpu"."""
    if torch.cuda.is_available():
        return "cuda"
    if _torch_npu_installed():
        importlib.import_module("torch_npu")
        if torch.npu.is_available():
            return "npu"
    return "cpu"


def _cuda_backend(device: str) -> DeviceBackend:
    if not torch.cuda.is_available():
        return _without_graphs(
            "cuda", device, "graph modes need CUDA, and torch.cuda.is_available() is False here"
        )
    return DeviceBackend(
        name="cuda",
        device=device,
        module=torch.cuda,
        graph_class_name="CUDAGraph",
        in_graph_timing=True,
    )


def _npu_backend(device: str) -> DeviceBackend:
    if not _torch_npu_installed():
        return _without_graphs(
            "npu", device, "graph modes on NPU need torch_npu, which is not installed here"
        )
    importlib.import_module("torch_npu")
    if not torch.npu.is_available():
        return _without_graphs("npu", device, "torch_npu is installed but sees no NPU")
    # In-graph timing events are not claimed for NPUGraph: nobody has checked them on an NPU.
    return DeviceBackend(name="npu", device=device, module=torch.npu, graph_class_name="NPUGraph")


def _without_graphs(name: str, device: str, reason: str) -> DeviceBackend:
    return DeviceBackend(name=name, device=device, module=None, unavailable_reason=reason)


def _torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None
