"""Every vLLM-specific touch point of tracekit, and nothing else.

vLLM's runner internals move fast (SchedulerOutput fields differ between releases; 0.34 ships only
the V2 GPU runner), so recording and replaying code talks to vLLM only through this package
(`tests/test_layering.py` fails on a vLLM import or a listed vLLM attribute anywhere else), and
each layer above through one facade of it:

  `recording`      the seam `tracekit.record` reaches vLLM through
  `replay_engine`  the seam `tracekit.replay` reaches vLLM through
  `serving`        tracekit inside vLLM's API server: the live-control routes, the worker method
                   they reach, tracekit's lines in the server's log (reached through `recording`)
  releases/        what is true of each supported release series, one module each, on a common base
  runners/         where each model runner kind keeps a step: the adapters record and replay share
  records/         vLLM's objects as tracekit's records and back: serialised, edited, read
  engines/         building engines (in-process, lean, for replay) and driving recorded steps
                   through their runners, in every worker and rank
"""
