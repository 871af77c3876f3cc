"""Copying device tensors to host, and reading a device-side flag, without stalling the engine's
stream longer than the copy itself (a plain `.to("cpu")` waits for the whole stream, then copies
through pageable memory; docs/PERFORMANCE.md measures what a firing step costs).

`HostCopy` gathers the rows on a side stream that starts behind the engine's stream, copies them
into pinned host memory asynchronously, and makes the engine's stream wait for the copy
(device-side): the next step's kernels, which may reuse the blocks, run after it. The host waits
only where the bytes are read (`wait()`, on the bundle writer's thread); without streams (CPU) it
copies at once. `DeviceFlag` brings a device boolean ("every output is finite") to host the same
way: read once the stream passed it, it costs no sync. `context_lost` says whether a failure left
the device context unusable: after one, nothing can be read back.
"""

from typing import Any, Callable

import torch

from tracekit.graphs.device import DeviceBackend

_side_streams: dict[str, Any] = {}


def _side_stream(backend: DeviceBackend) -> Any:
    stream = _side_streams.get(backend.device)
    if stream is None:
        stream = _side_streams[backend.device] = backend.module.Stream(device=backend.device)
    return stream


class HostCopy:
    """One batch of device-to-host copies (see the module docstring); on a device without
    streams every copy is done when `gather` returns."""

    def __init__(self, backend: DeviceBackend):
        self.backend = backend
        self.asynchronous = backend.module is not None
        self.bytes = 0
        self._event: Any = None
        self._sources: list[torch.Tensor] = []  # device tensors kept alive until the copy is done
        self._timing: tuple[Any, Any] | None = None
        if self.asynchronous:
            module = backend.module
            self._main = module.current_stream(backend.device)
            self._stream = _side_stream(backend)
            self._stream.wait_stream(self._main)
            self._timing = (module.Event(enable_timing=True), module.Event(enable_timing=True))
            self._timing[0].record(self._stream)

    def gather(self, tensor: torch.Tensor, dim: int, index: list[int]) -> torch.Tensor:
        """Rows `index` of `tensor` along `dim`, as a new host tensor."""
        if not self.asynchronous:
            rows = torch.tensor(index, dtype=torch.long, device=tensor.device)
            host = tensor.index_select(dim, rows).to("cpu")
            self.bytes += host.numel() * host.element_size()
            return host
        with self.backend.module.stream(self._stream):
            rows = torch.tensor(index, dtype=torch.long).to(tensor.device, non_blocking=True)
            return self._to_pinned(tensor.index_select(dim, rows))

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as a new host tensor."""
        if not self.asynchronous or tensor.device.type == "cpu":
            host = tensor.detach().to("cpu", copy=True)
            self.bytes += host.numel() * host.element_size()
            return host
        with self.backend.module.stream(self._stream):
            return self._to_pinned(tensor.detach())

    def computed(self, compute: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """What `compute()` returns, computed where the copies run (after the engine's work so far,
        before its next), as a new host tensor: a reduction of device state whose inputs need no
        copy of their own. None where it returns None."""
        if not self.asynchronous:
            result = compute()
            return self.copy(result) if result is not None else None
        with self.backend.module.stream(self._stream):
            result = compute()
            return self._to_pinned(result) if result is not None else None

    def _to_pinned(self, source: torch.Tensor) -> torch.Tensor:
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
        self._sources.append(source)
        self.bytes += host.numel() * host.element_size()
        return host

    def finish(self) -> "HostCopy":
        """Every copy is issued: the engine's stream waits for them (device-side) from here on."""
        if self.asynchronous and self._event is None:
            self._timing[1].record(self._stream)
            self._event = self._timing[1]
            self._main.wait_event(self._event)
        return self

    @property
    def device_us(self) -> float | None:
        """How long the copies held the side stream (which the engine's stream waits for), once
        `wait()` returned; None where they ran at once on the host (no streams)."""
        if self._timing is None or self._event is None or not self._event.query():
            return None
        return self._timing[0].elapsed_time(self._timing[1]) * 1e3

    def wait(self) -> None:
        """Block until every copy landed in host memory."""
        self.finish()
        if self._event is not None:
            self._event.synchronize()
            self._sources.clear()


class DeviceFlag:
    """A device boolean brought to host without a sync: `ready()` says whether the stream has
    passed it, `value()` reads it (waiting if not)."""

    def __init__(self, flag: torch.Tensor, backend: DeviceBackend):
        self._event = None
        if backend.module is None or flag.device.type == "cpu":
            self._host = flag
            return
        self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self._host.copy_(flag, non_blocking=True)
        self._event = backend.module.Event()
        self._event.record(backend.module.current_stream(backend.device))

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host)


def all_finite(tensors: list[torch.Tensor | None], exact: bool = False) -> torch.Tensor:
    """One device boolean: whether every floating-point tensor of `tensors` is finite.

    By default from their sums, accumulated in float32 (one reduction per tensor, no boolean
    copy of it: a few times cheaper than `isfinite().all()`): any NaN or inf makes the sum
    non-finite, and so could finite values summing past float32's range (1e38), which outputs
    never approach; `exact=True` checks element by element, to confirm a positive."""
    tensors = [t for t in tensors if t is not None and t.is_floating_point() and t.numel()]
    if not tensors:
        return torch.tensor(True)
    if exact:
        flags = [torch.isfinite(tensor).all() for tensor in tensors]
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()
    total = tensors[0].sum(dtype=torch.float32)
    for tensor in tensors[1:]:
        total = total + tensor.sum(dtype=torch.float32)
    return torch.isfinite(total)


# Words of the errors after which a CUDA (or NPU) context cannot run or read anything again.
_CONTEXT_LOST = (
    "device-side assert", "illegal memory access", "illegal address", "misaligned address",
    "unspecified launch failure", "an illegal instruction", "CUDA error: uncorrectable", "ECC error",
    "launch timeout", "hardware stack error",
)


def context_lost(error: BaseException) -> bool:
    """Whether `error` is one after which the device context is poisoned."""
    if type(error).__name__ == "AcceleratorError":
        return True
    text = str(error)
    return any(words in text for words in _CONTEXT_LOST)
