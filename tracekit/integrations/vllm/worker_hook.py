"""Finding each model runner vLLM builds inside its own processes (for the plugin).

A plugin cannot hold the `LLM`; it can only patch classes before vLLM instantiates them. The
moment a runner is final — KV cache allocated, compiled, graphs captured, warm-up done — is the
end of its worker's `compile_or_warm_up_model`, on every platform's worker class.
"""

import importlib
from typing import Any, Callable

from tracekit.integrations.vllm.method_patch import call_after

WORKER_CLASSES = (
    ("vllm.v1.worker.gpu_worker", "Worker"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker"),
    ("vllm_ascend.worker.worker", "NPUWorker"),
)


def on_each_runner_ready(callback: Callable[[Any], None]) -> None:
    """Call `callback(model_runner)` whenever a worker of this process finishes warming up."""
    for module_name, class_name in WORKER_CLASSES:
        try:
            worker_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        call_after(worker_class, "compile_or_warm_up_model", lambda worker: callback(worker.model_runner))
