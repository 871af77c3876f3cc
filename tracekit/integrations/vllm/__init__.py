"""Every vLLM-specific touch point of tracekit, and nothing else.

vLLM's runner internals move fast (SchedulerOutput fields differ between releases; 0.34 ships only
the V2 GPU runner), so recording and replaying code talks to vLLM only through these modules
(`tests/test_layering.py` fails on a vLLM import or a listed vLLM attribute anywhere else):

  releases/         one module per supported release series (or an alias of one): what is true of it
  release.py        the base of those: runner adapters, scheduler outputs, allow-listed types,
                    worker classes, async outputs, runner kinds, engine settings
  version.py        which vLLM is installed, and its release support
  runner_adapter.py the base of the runner adapters: what record and replay do alike on a runner
  v1_runner.py      where the V1 model runner keeps a step
  v2_runner.py      where Model Runner V2 keeps a step
  runner_state.py   what both runners keep alike: KV cache groups and blocks, graph tables,
                    the attention metadata's summary
  step_driver.py    driving one recorded step through a rebuilt runner, repeatably
  serialize.py      vLLM objects <-> plain data, field by field, no pickle
  engine.py         building in-process engines (`build_llm`, the one place an LLM is made),
                    reaching their runner
  weights.py        naming weights by their bytes: the model's, a LoRA adapter's
  grammar.py        a step's structured-output grammar mask: vLLM's GrammarOutput as a record
                    and back, and the mask as it reached the logits
  lora_adapters.py  the LoRA adapters in a step's slots: read when recording, found, checked and
                    put back into their slots when replaying
  step_features.py  what a step used beyond tokens (grammar, LoRA, drafts, multimodal inputs,
                    prompt embeddings), and what of it this tracekit cannot replay yet
  replay_engine.py  the one seam `tracekit.replay` reaches vLLM through: a replay engine (lean,
                    full, or one for a timing mode), its adapter, a step driver, machine checks
  lean_build.py     building a replay engine with only what its steps need
  method_patch.py   shadowing a runner's methods (and calls) for one armed session
  ranks.py          a runner's place in a multi-rank engine, the layouts this machine can build
  workers.py        the transport that runs tracekit's functions in every worker process
  graph_backend.py  plugging tracekit's piecewise graph backend into vLLM's compilation
  layer_capture.py  forward hooks on the model's decoder layers: per-layer outputs of one forward
  platform_facts.py what only a live engine says about numerics: attention backend and kernel ISA
  bench_shapes.py   recorded batches as `vllm bench forward --shapes` cases (metadata only)
  step_records.py   what sampling reads of a request's tokens; the SchedulerOutput record of a
                    shrunk or redacted batch
"""
