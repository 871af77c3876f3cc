"""tracekit: record one exact vLLM engine step into a portable bundle, then replay, check and
time that very forward on another machine.

Layout: the layers, from the file up to the command line (each package has one job):
  format/        the bundle file: container, tensor codec, integrity, content schema
  graphs/        device seam, one-shot graph capture, piecewise graph backend, timing, the
                 Triton kernels' recorded configurations
  integrations/  every vLLM-specific touch point (versions move fast; keep them in one place)
  record/        arming a recorder inside a live engine, triggers, the serve plugin
  replay/        rebuilding the runner from a bundle, running, comparing and timing the step
  share/         making a bundle fit to hand on: shrink (cut a step down while a property
                 holds), redact (keep only what the step's forward and sampling read); and
                 invariance (does each request come out the same in other batches)
  cli/           the `tracekit` command
Beside them:
  models/        the tiny Llama checkpoint shipped for tests and demos
and modules every layer may use: errors, outputs, numerics, environment, bundles.
"""

__version__ = "0.1.0"

# The layers, bottom first: a module may import only from its own layer and those below it
# (`tests/test_layering.py` walks every import, lazy ones too). Modules of one tuple are one layer.
LAYERS = (
    ("tracekit.errors", "tracekit.numerics", "tracekit.models"),
    ("tracekit.format", "tracekit.outputs", "tracekit.bundles"),
    ("tracekit.graphs", "tracekit.environment"),
    ("tracekit.integrations",),
    ("tracekit.record",),
    ("tracekit.replay",),
    ("tracekit.share",),
    ("tracekit.cli", "tracekit.__main__"),
)
