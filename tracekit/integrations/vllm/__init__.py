"""Every vLLM-specific touch point of tracekit, and nothing else.

vLLM's runner internals move fast (SchedulerOutput fields differ between 0.32, 0.33 and 0.34;
0.34 ships only the V2 GPU runner), so recording and replaying code talks to vLLM only through
these modules:

  version.py        which vLLM is installed and whether a bundle's vLLM objects fit it
  serialize.py      vLLM objects <-> plain data, field by field, no pickle
  engine.py         engine args <-> a live engine, reaching the model runner, the weights
  runner_adapter.py the seam: what record and replay need from a runner, and which adapter serves it
  v1_runner.py      the V1 model runner's adapter: every V1 attribute tracekit touches
  v2_runner.py      Model Runner V2's adapter: every V2 attribute tracekit touches
  runner_state.py   what both runners keep alike: KV cache groups and blocks, graph tables
  replay_batch.py   turning recorded request states back into a SchedulerOutput the runner accepts
  step_driver.py    driving one recorded step through a rebuilt runner, repeatably
  method_patch.py   shadowing a runner's methods for one armed session
  worker_hook.py    finding each runner vLLM builds in its own processes (for the plugin)
  ranks.py          a runner's place in a multi-rank engine, the layouts this machine can build
  workers.py        tracekit's functions run in every worker process through collective_rpc
  graph_backend.py  plugging tracekit's piecewise graph backend into vLLM's compilation
  layer_capture.py  forward hooks on the model's decoder layers: per-layer outputs of one forward
  platform_facts.py what only a live engine says about numerics: attention backend and kernel ISA
  bench_shapes.py   recorded batches as `vllm bench forward --shapes` cases (metadata only)
  step_records.py   what sampling reads of a request's tokens; the SchedulerOutput record of a
                    shrunk or redacted batch
"""
