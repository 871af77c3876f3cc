"""Recording: arming a recorder inside a live vLLM engine and writing the steps it picks.

`triggers` decides which steps fire and `capture_kinds` how a firing step is captured (a step
trigger copies the N >= 1 steps of the bundle it opens before their forwards; an event trigger
marks each step, copied only if it fails or is not finite); `step_capture` copies a step to host
on the engine's critical path, `sampled_ids` the ids a V1 runner under async scheduling does not;
`persist` writes bundles on a background thread; `recorder` ties them to a model runner. `api`
(an `LLM` you hold), `session` (`tracekit record`) and `plugin` (`vllm serve`) arm it,
`arm_in_workers` inside an engine's worker processes; `settings` checks what a request to arm a
running server asks (and that it writes only under the folder the operator named), and `live`
arms, re-arms, reports and disarms it there without a restart. `workload` is what `tracekit
record` sends when no prompts are given.
"""
