"""Where each vLLM model runner kind keeps a step, behind one adapter base both record and replay use.

  `runner_adapter`  the base of the adapters: what record and replay do alike on any runner
  `v1_runner`       where the V1 model runner keeps a step
  `v2_runner`       where Model Runner V2 keeps a step
  `runner_state`    what both runners keep alike: KV cache groups and blocks, graph tables,
                    the attention metadata's summary
  `step_shadows`    the shadows that follow a step through a runner and report it to an observer
  `method_patch`    shadowing a runner's methods (and calls) for one armed session
  `layer_capture`   forward hooks on the model's decoder layers: per-layer outputs of one forward
  `lora_adapters`   the LoRA adapters in a step's slots: read when recording, put back when replaying
  `kv_digest`       a digest of the KV a step wrote, per layer and request, where the cache is
"""
