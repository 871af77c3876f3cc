"""Building vLLM engines and driving recorded steps through their runners.

  `build`           building in-process engines (`build_llm`, the one place an LLM is made),
                    reaching their runner
  `lean_build`      building a replay engine with only what its steps need
  `step_driver`     driving one recorded step through a rebuilt runner, repeatably
  `sequence_driver` driving a bundle's steps (N >= 1), the runner carrying its state
  `graph_backend`   plugging tracekit's piecewise graph backend into vLLM's compilation
  `ranks`           a runner's place in a multi-rank engine, the layouts this machine can build
  `engine_options`  vLLM's engine options, read from its source without importing it
  `workers`         the transport that runs tracekit's functions in every worker process
  `platform_facts`  what only a live engine says about numerics: attention backend and kernel ISA
"""
