"""Graph capture for replays: the device seam (`device`), one-shot exact capture (`oneshot`), the
piecewise `torch.compile` backend (`piecewise`) configured from a recorded `capture_table`,
per-piece divergence (`divergence`), shared timing (`timing`) and the per-mode replay entry point
(`modes`). docs/GRAPHS.md describes how they fit together and how vLLM is plugged in.
"""
