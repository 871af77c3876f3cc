"""Replaying bundles. `replay(bundle)` (`replayer`) opens a bundle's steps (`opened`), checks this
machine, gets an engine through one seam to vLLM (`tracekit.integrations.vllm.replay_engine`), runs
the steps, checks them item by item (`checks`, `dispatch`), times them (`timed_modes`) and decides a
verdict (`verdict`, `verdict_names`) into a `result`; a step that does not reproduce is replayed
again (`repeats`, in a fresh process through `repeat_worker`). `suite` replays many bundles,
`multirank` every rank of one step (`replay_in_workers` inside each rank's worker); `kv_sources`
says where a parted step's KV came from; `plots` draws `--plot` (`replayer` writes `--save-layers`).
What `tracekit replay` was asked is a `request` of `options`, free of torch.
"""
