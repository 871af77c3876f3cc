"""Every vLLM-specific touch point of tracekit, and nothing else.

vLLM's runner internals move fast (SchedulerOutput fields differ between 0.32, 0.33 and 0.34;
0.34 ships only the V2 GPU runner), so recording and replaying code talks to vLLM only through
these modules:

  version.py      which vLLM is installed and whether a bundle's vLLM objects fit it
  serialize.py    vLLM objects <-> plain data, field by field, no pickle
  engine.py       engine args <-> a live engine, reaching the model runner, the weights
  runner_state.py reading a step's request states, KV cache geometry and graph dispatch
  method_patch.py shadowing runner methods for one armed session
  replay_batch.py turning recorded request states back into a SchedulerOutput the runner accepts
  graph_backend.py plugging tracekit's piecewise graph backend into vLLM's compilation
  step_records.py what sampling reads of a request's tokens; the SchedulerOutput record of a
                  shrunk or redacted batch
"""
