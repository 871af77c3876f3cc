"""Replaying: `replayer.replay(bundle)` rebuilds the engine a bundle describes (`engine`), drives
its step through the runner (`tracekit.integrations.vllm.step_driver`), compares it with the
recording item by item (`checks`), audits its dispatch (`dispatch`), times it per mode
(`timed_modes`) and decides a verdict (`verdict`) into a `result`; `suite` replays many,
`multirank` every rank of one step. The reports that print them are the CLI's (`tracekit.cli`).
"""
