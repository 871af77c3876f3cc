"""Replaying: `replay(bundle)` (in `replayer`) opens a bundle's steps (`opened`: read once, from the
command line down; a bundle is a sequence of N >= 1 steps), checks this machine, gets an engine,
runs the steps and compares each with the recording item by item (`checks`), audits its dispatch (`dispatch`), times it per mode
(`timed_modes`) and decides a verdict (`verdict`; names and exit codes in `verdict_names`) into a
`result`; a step that does not reproduce is replayed again (`repeats`, in a fresh process through
`repeat_worker`) to tell an engine that does not repeat itself. `suite` replays many, `multirank` every rank of one step (`replay_in_workers` inside each
rank's worker); `kv_sources` says where a parted step's KV came from.
`layers_bundle` writes `replay --layers`' per-layer outputs, `plots` draws `--plot`. Everything it
asks of vLLM goes through one seam, `tracekit.integrations.vllm.replay_engine`. The reports that
print them are the CLI's (`tracekit.cli`); what `tracekit replay` was asked is a `request` (its
`plan`, carried out by `carry_out`) of per-bundle `options`, both free of torch.
"""
