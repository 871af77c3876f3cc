"""Building vLLM engines and driving recorded steps through their runners.

  build.py          building in-process engines (`build_llm`, the one place an LLM is made),
                    reaching their runner
  lean_build.py     building a replay engine with only what its steps need
  step_driver.py    driving one recorded step through a rebuilt runner, repeatably
  window_driver.py  driving a window of recorded steps, the runner carrying its state
  graph_backend.py  plugging tracekit's piecewise graph backend into vLLM's compilation
  ranks.py          a runner's place in a multi-rank engine, the layouts this machine can build
  workers.py        the transport that runs tracekit's functions in every worker process
  platform_facts.py what only a live engine says about numerics: attention backend and kernel ISA
"""
