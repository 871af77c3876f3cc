"""How two tensors are compared, everywhere in tracekit (replay checks, graph-vs-eager checks,
per-piece divergence): one definition, so that a number `tracekit replay` prints means the same as
a graph report's (`max_abs` and `relative_rms` as vLLM's forward bench computes them).
"""

from dataclasses import dataclass
from typing import Any

import torch


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """Compare `actual` against the reference `expected`; shapes must match to be comparable."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    if actual.shape != expected.shape:
        return {
            "bit_exact": False,
            "shape_mismatch": [list(actual.shape), list(expected.shape)],
            "max_abs": float("inf"),
            "relative_rms": float("inf"),
            "max_abs_vs_rms": float("inf"),
        }
    # bitwise: NaNs with the same payload count as equal, -0.0 and 0.0 do not
    bit_exact = actual.dtype == expected.dtype and torch.equal(
        actual.contiguous().reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8))
    if actual.numel() == 0:
        return {"bit_exact": bit_exact, "max_abs": 0.0, "relative_rms": 0.0, "max_abs_vs_rms": 0.0}
    if actual.dtype == torch.bool or expected.dtype == torch.bool:
        actual, expected = actual.to(torch.int8), expected.to(torch.int8)
    delta = actual.double() - expected.double()
    scale = expected.double().square().mean().sqrt().clamp(min=1e-12)
    max_abs = float(delta.abs().nan_to_num(nan=float("inf")).max())
    result = {
        "bit_exact": bit_exact,
        "max_abs": max_abs,
        "relative_rms": float(delta.square().mean().sqrt() / scale),
        "max_abs_vs_rms": max_abs / float(scale),
    }
    if actual.is_floating_point() and actual.dim() >= 2 and actual.shape[-1] > 1:
        result["argmax_agreement"] = float(
            (actual.argmax(dim=-1) == expected.argmax(dim=-1)).double().mean()
        )
    return result


@dataclass(frozen=True)
class PlatformBound:
    """How far a float item may drift when only the platform differs (other kernels, other
    rounding), scale-free: both the relative RMS and the worst element over the RMS."""

    relative_rms: float
    max_abs_vs_rms: float


# Calibrated by tools/calibrate_platform_bounds.py (AVX512 vs AVX2 kernels, every float item of
# eight steps of the built-in workload, both directions); docs/VERDICTS.md has the measurements
# and the margin. A dtype not listed has no bound: its items can only be bit-exact or diverged.
PLATFORM_BOUNDS: dict[str, PlatformBound] = {
    "float32": PlatformBound(relative_rms=1e-5, max_abs_vs_rms=5e-5),
    "bfloat16": PlatformBound(relative_rms=5e-2, max_abs_vs_rms=5e-1),  # a smaller margin: see the doc
    "float16": PlatformBound(relative_rms=1e-2, max_abs_vs_rms=1e-1),
}


def within_platform_bound(comparison: dict[str, Any], dtype: str | None) -> bool:
    """Whether a `compare_tensors` result of a `dtype` tensor is within its platform bound."""
    bound = PLATFORM_BOUNDS.get(dtype or "")
    if bound is None or "shape_mismatch" in comparison:
        return False
    return (
        comparison.get("relative_rms", float("inf")) <= bound.relative_rms
        and comparison.get("max_abs_vs_rms", float("inf")) <= bound.max_abs_vs_rms
    )
