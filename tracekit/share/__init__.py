"""Preparing a recorded step for another team, and asking what it depends on: `shrink` (the
smallest batch that still shows a property: `properties` are what it keeps true, `reduce_step`
cuts a step, `shrink_trials` is what every search shares, `shrink_window` cuts a window's steps and
requests), `redact` (remove what the forward does not read) and `invariance` (does each request
come out the same in other batches, built by `batch_variants`); `summary` is what `tracekit
inspect` prints of a bundle without loading its tensors."""
