"""Recording: arming a recorder inside a live vLLM engine and writing the steps it picks.

`triggers` decides which steps fire, `step_capture` copies a step to host on the engine's
critical path, `persist` writes bundles on a background thread, `recorder` ties them to a model
runner; `api` (an `LLM` you hold), `session` (`tracekit record`) and `plugin` (`vllm serve`) arm
it. `workload` is what `tracekit record` sends when no prompts are given.
"""
