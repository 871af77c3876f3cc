"""The capture-size table a recording carries: which batch sizes the engine compiled for, which it
captured graphs for, after how many warm-up runs, and in which graph mode.

The piecewise backend is configured from it so that a replay captures what the recorded engine
captured; it travels in bundles as plain data (`to_plain`/`from_plain`).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from tracekit.errors import BundleError

# vLLM's CUDAGraphMode names, lower-cased (not `--mode`'s replay modes, `graphs.modes`); only the
# piecewise part matters to the backend here.
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")


@dataclass(frozen=True)
class CaptureTable:
    mode: str
    capture_sizes: tuple[int, ...]
    compile_sizes: tuple[int, ...] = ()
    num_warmups: int = 0
    debug: bool = False

    def __post_init__(self) -> None:
        if self.mode not in CUDAGRAPH_MODES:
            raise BundleError(f"capture table: unknown graph mode {self.mode!r}")
        for name in ("capture_sizes", "compile_sizes"):
            sizes = getattr(self, name)
            if any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes):
                raise BundleError(f"capture table: {name} must be positive integers, got {sizes}")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))
        if not isinstance(self.num_warmups, int) or self.num_warmups < 0:
            raise BundleError(f"capture table: bad num_warmups {self.num_warmups!r}")

    @property
    def captures_pieces(self) -> bool:
        """Whether this mode captures piecewise graphs at all (else sizes are only compiled)."""
        return self.mode in ("piecewise", "full_and_piecewise")

    def to_plain(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> "CaptureTable":
        unknown = set(plain) - {field.name for field in dataclasses.fields(cls)}
        if unknown or "mode" not in plain or "capture_sizes" not in plain:
            raise BundleError(
                f"capture table: needs mode and capture_sizes, unknown keys {sorted(unknown)}"
            )
        return cls(
            mode=str(plain["mode"]).lower(),
            capture_sizes=tuple(plain["capture_sizes"]),
            compile_sizes=tuple(plain.get("compile_sizes", ())),
            num_warmups=plain.get("num_warmups", 0),
            debug=bool(plain.get("debug", False)),
        )
