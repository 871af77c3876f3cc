"""Replaying: `replayer.replay(bundle)` rebuilds the engine a bundle describes, drives its step
through the runner (`tracekit.integrations.vllm.step_driver`), compares it with the recording
item by item (`checks`), times it per mode (`tracekit.graphs.modes`) and `report` prints it.
"""
