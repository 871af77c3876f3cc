"""The requests `tracekit record` sends: a built-in workload, or a prompts file.

The built-in workload is shaped so the embedded tiny model produces every kind of step a
replay must handle: short prompts that finish prefill at once and then decode, a long prompt
that is chunked (the small token budget in `EMBEDDED_MODEL_ENGINE_ARGS` forces it) and so runs its
prefill chunks beside the others' decodes, greedy, seeded and unseeded sampling, penalties,
`min_tokens` (end-of-sequence masked until then) and sampled-token logprobs.

A prompts file (`--prompts`, its format in docs/GUIDE.md, "Recording") is JSON lines or plain text.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.errors import UsageError

# The engine the embedded tiny model is recorded with (a model the user names gets vLLM's own
# defaults: a real model needs vLLM's KV cache sizing, dtype and token budget, which the bundle
# then pins for its replay).
EMBEDDED_MODEL_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",  # vLLM would otherwise run the float32 checkpoint in bfloat16 on CPU
    "block_size": 32,  # the CPU attention backend needs a multiple of 32
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,  # small, so long prompts are prefilled in chunks
    "seed": 0,
    "kv_cache_memory_bytes": 64 << 20,  # fixed, so block ids do not depend on free memory
}

_LONG_PROMPT = " ".join(
    "the quick brown fox jumps over the lazy dog while the engine schedules another chunk".split()
    * 6
)


@dataclass
class WorkloadRequest:
    prompt: str | list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    lora: dict[str, Any] | None = None  # {"name", "path"}: the LoRA adapter it runs with


BUILTIN_WORKLOAD = [
    WorkloadRequest("Hello, my name is", {"temperature": 0.0}),
    WorkloadRequest("The capital of France is", {"temperature": 0.8, "seed": 7}),
    WorkloadRequest("Once upon a time", {"temperature": 1.0, "min_tokens": 6, "logprobs": 3}),
    WorkloadRequest(
        "A list of colours: red, green,",
        {"temperature": 0.0, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2},
    ),
    WorkloadRequest(_LONG_PROMPT, {"temperature": 0.0}),
]
DEFAULT_MAX_TOKENS = 12


def load_prompts(path: str | Path) -> list[WorkloadRequest]:
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as error:
        raise UsageError(f"cannot read prompts file {path}: {error.strerror}") from error
    if not lines:
        raise UsageError(f"prompts file {path} holds no prompts")
    if not lines[0].lstrip().startswith("{"):
        return [WorkloadRequest(line) for line in lines]
    requests = []
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{number}: not JSON: {error.msg}") from error
        if not isinstance(entry, dict):
            raise UsageError(f"{path}:{number}: each line must be a JSON object")
        prompt = entry.pop("prompt", None) or entry.pop("prompt_token_ids", None)
        valid_text = isinstance(prompt, str)
        valid_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (valid_text or valid_ids):
            raise UsageError(f"{path}:{number}: needs \"prompt\" (text) or \"prompt_token_ids\" (ints)")
        lora = entry.pop("lora", None)
        if lora is not None and not (isinstance(lora, dict) and isinstance(lora.get("name"), str)
                                     and isinstance(lora.get("path"), str)):
            raise UsageError(f"{path}:{number}: \"lora\" needs a \"name\" and a \"path\" (the adapter's folder)")
        requests.append(WorkloadRequest(prompt, entry, lora))
    return requests


def run_workload(llm: Any, requests: list[WorkloadRequest], max_tokens: int) -> list[Any]:
    """Send every request in one `generate` call, so they share engine steps."""
    from tracekit.integrations.vllm.recording import generate

    return generate(llm, [r.prompt for r in requests], [{"max_tokens": max_tokens, **r.sampling} for r in requests],
                    [r.lora for r in requests])
