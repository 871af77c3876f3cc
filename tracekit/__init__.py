"""tracekit: record one exact vLLM engine step into a portable bundle, then replay, check and
time that very forward on another machine.

Layout (each package has one job):
  format/        the bundle file: container, tensor codec, integrity, schema
  integrations/  every vLLM-specific touch point (versions move fast; keep them in one place)
  record/        arming a recorder inside a live engine, triggers, the serve plugin
  replay/        rebuilding the runner from a bundle, running, comparing and timing the step
  graphs/        device seam, one-shot graph capture, piecewise graph backend
  cli/           the `tracekit` command
"""

__version__ = "0.1.0"
