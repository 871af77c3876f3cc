"""Recording: arming a recorder inside a live vLLM engine and writing the steps it picks.

`triggers` decides which steps fire and `capture_kinds` how a firing step is captured;
`step_capture` copies a step to host on the engine's critical path, `sampled_ids` keeps the ids a
V1 runner under async scheduling does not; `persist` writes bundles on a background thread;
`recorder` ties them to a model runner. `api` (an `LLM` you hold), `session` (`tracekit record`)
and `plugin` (`vllm serve`) arm it, `arm_in_workers` inside an engine's worker processes;
`settings` checks what a request to arm asks, and `live` arms, re-arms, reports and disarms it in
a running server. `workload` is what `tracekit record` sends when no prompts are given.
"""
