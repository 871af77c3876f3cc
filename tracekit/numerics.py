"""How two tensors are compared, everywhere in tracekit (replay checks, graph-vs-eager checks,
per-piece divergence).

One definition so that a number printed by `tracekit replay` means the same as the one in a
graph report: `max_abs` and `relative_rms` as vLLM's forward bench computes them, plus exact
equality and, for logits-like tensors, argmax agreement along the last dimension.
"""

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
        }
    bit_exact = actual.dtype == expected.dtype and _same_bytes(actual, expected)
    if actual.numel() == 0:
        return {"bit_exact": bit_exact, "max_abs": 0.0, "relative_rms": 0.0}
    if actual.dtype == torch.bool or expected.dtype == torch.bool:
        actual, expected = actual.to(torch.int8), expected.to(torch.int8)
    delta = actual.double() - expected.double()
    scale = expected.double().square().mean().sqrt().clamp(min=1e-12)
    result = {
        "bit_exact": bit_exact,
        "max_abs": float(delta.abs().nan_to_num(nan=float("inf")).max()),
        "relative_rms": float(delta.square().mean().sqrt() / scale),
    }
    if actual.is_floating_point() and actual.dim() >= 2 and actual.shape[-1] > 1:
        result["argmax_agreement"] = float(
            (actual.argmax(dim=-1) == expected.argmax(dim=-1)).double().mean()
        )
    return result


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: NaNs with the same payload count as equal, -0.0 and 0.0 do not."""
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )
