"""Adapters to the serving engines tracekit records from: `seam`, what record and replay need from
a model runner (torch-free), and one package per engine. Only `vllm/` exists today."""
