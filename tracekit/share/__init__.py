"""Preparing a recorded step for another team, and asking what it depends on: `shrink` (the
fewest steps and requests that still show a property: `properties` are what it keeps true,
`reduce_step` cuts steps, `shrink_trials` is what its search is built from), `redact` (remove what the forward does not read) and `invariance` (does each request
come out the same in other batches, built by `batch_variants`); `summary` is what `tracekit
inspect` prints of a bundle without loading its tensors."""
