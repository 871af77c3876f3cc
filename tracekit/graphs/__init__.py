"""Graph capture for replays: the device seam (`device`), one-shot exact capture (`oneshot`), the
piecewise `torch.compile` backend (`piecewise`: the forward split at named ops by `piece_split`,
each piece compiled by `piece_compilers`) configured from a recorded capture table
(`capture_table`), per-piece divergence (`divergence`), shared timing (`timing`), profiler traces
(`profiling`) and the per-mode replay entry point (`modes`). Beside them, what recording and
replaying need from the device: copies to host that do not stall the engine (`host_copy`), and
the recorded launch configurations of the Triton kernels a step ran (`kernel_choices`). docs/GRAPHS.md describes how they fit together and how vLLM is plugged in.
"""
