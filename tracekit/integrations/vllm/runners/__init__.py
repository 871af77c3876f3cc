"""Where each vLLM model runner kind keeps a step, behind one adapter base both record and replay use.

  runner_adapter.py the base of the adapters: what record and replay do alike on any runner
  v1_runner.py      where the V1 model runner keeps a step
  v2_runner.py      where Model Runner V2 keeps a step
  runner_state.py   what both runners keep alike: KV cache groups and blocks, graph tables,
                    the attention metadata's summary
  step_shadows.py   the shadows that follow a step through a runner and report it to an observer
  method_patch.py   shadowing a runner's methods (and calls) for one armed session
  layer_capture.py  forward hooks on the model's decoder layers: per-layer outputs of one forward
  lora_adapters.py  the LoRA adapters in a step's slots: read when recording, put back when replaying
  kv_digest.py      a digest of the KV a step wrote, per layer and request, where the cache is
"""
