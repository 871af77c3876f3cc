"""Adapters to the serving engines tracekit records from. Only `vllm/` exists today."""
