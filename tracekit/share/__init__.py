"""Preparing a recorded step for another team: `shrink` (the smallest batch that still shows a
property) and `redact` (remove what the forward does not read)."""
