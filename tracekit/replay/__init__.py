"""Replaying bundles. `replay(bundle)` (`replayer`) opens a bundle's steps (`opened`), checks this
machine, gets an engine through one seam to vLLM (`tracekit.integrations.vllm.replay_engine`), runs
the steps, checks them item by item (`checks`, `dispatch`), times them (`timed_modes`) and decides a
verdict (`verdict`, `verdict_names`) into a `result`; a step that does not reproduce is replayed
again (`repeats`). `suite` replays many bundles, `multirank` every rank of one step; what
`tracekit replay` was asked is a `request`, free of torch. The CLI prints the reports.
"""
