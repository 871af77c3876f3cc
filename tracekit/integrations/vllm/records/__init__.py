"""vLLM's objects as tracekit's records and back: what a bundle holds of them, read and edited.

  `serialize`       vLLM objects <-> plain data, field by field, no pickle
  `step_records`    what sampling reads of a request's tokens; the SchedulerOutput record of a
                    shrunk or redacted batch
  `window_records`  the request states of a window's later steps, derived from the bundle
  `grammar`         a step's structured-output grammar mask: vLLM's GrammarOutput as a record and
                    back, and the mask as it reached the logits
  `spec_decode`     what a step of a speculatively decoding engine holds, on both runners
  `step_features`   what a step used beyond tokens, and what of it this tracekit cannot replay yet
  `weights`         naming weights by their bytes: the model's, a LoRA adapter's
  `request_ids`     the ids a client of vLLM's API server sees, matched to the engine's request ids
  `needs`           what a bundle needs of the machine that replays it, in one line
  `bench_shapes`    recorded batches as `vllm bench forward --shapes` cases (metadata only)
"""
