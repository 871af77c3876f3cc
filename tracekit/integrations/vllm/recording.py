"""The one seam between `tracekit.record` and vLLM: what arming a recorder in a live engine and
copying its steps ask of vLLM, listed in one place.

`tracekit.record` talks to a runner adapter through `tracekit.integrations.seam` and takes
everything else it needs of vLLM from here (`tests/test_layering.py` allows it no other
integration module), as `tracekit.replay` takes what it needs from `replay_engine`.
"""

from tracekit.integrations.vllm.engines.build import build_llm, find_runner, generate, parse_engine_cli_args
from tracekit.integrations.vllm.engines.ranks import rank_of, require_recordable
from tracekit.integrations.vllm.engines.step_driver import unknown_tokens_to_recompute
from tracekit.integrations.vllm.engines.workers import on_every_worker, reported, runner_in_this_process, runner_of
from tracekit.integrations.vllm.records.grammar import applied_mask
from tracekit.integrations.vllm.records.spec_decode import drafter_pass
from tracekit.integrations.vllm.records.step_features import step_features
from tracekit.integrations.vllm.records.window_records import RequestLedger
from tracekit.integrations.vllm.releases.installed import installed_release
from tracekit.integrations.vllm.runners.kv_digest import digested_layers, kv_written
from tracekit.integrations.vllm.runners.layer_capture import LayerCapture
from tracekit.integrations.vllm.runners.lora_adapters import AdapterFiles
from tracekit.integrations.vllm.runners.runner_adapter import RunnerAdapter, StepMark
from tracekit.integrations.vllm.runners.runner_state import blocks_read_and_written, blocks_to_host, hidden_states_of
from tracekit.integrations.vllm.serving import (
    LiveControlEndpoint,
    LiveControlOff,
    install_worker_method,
    route_logs_to_vllm,
)

__all__ = [
    "AdapterFiles", "LayerCapture", "LiveControlEndpoint", "LiveControlOff", "RequestLedger", "RunnerAdapter",
    "StepMark", "applied_mask", "blocks_read_and_written", "blocks_to_host", "build_llm", "digested_layers",
    "drafter_pass", "find_runner", "generate", "hidden_states_of", "install_worker_method", "installed_release",
    "kv_written", "on_every_worker", "parse_engine_cli_args", "rank_of", "reported", "require_recordable",
    "route_logs_to_vllm", "runner_in_this_process", "runner_of", "step_features", "unknown_tokens_to_recompute",
]
