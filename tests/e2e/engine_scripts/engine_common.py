"""What the engine scripts share: the engine `tracekit record` builds, and JSON results.

The scripts run in their own processes (a vLLM engine per process, in-process engine core);
tests start them through `tests/e2e/e2e_support.py` and read the JSON they write.
"""

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tracekit.integrations.vllm.engines.build import build_llm
from tracekit.models import tiny_model_path
from tracekit.record.workload import EMBEDDED_MODEL_ENGINE_ARGS

# Greedy and seeded only: their tokens do not depend on anything but the engine's numerics.
REPEATABLE_SAMPLING = [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}, {"temperature": 0.0}]
REPEATABLE_PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time there was"]


def eager_llm(**overrides: Any) -> Any:
    """The engine `tracekit record --enforce-eager` builds, with `overrides` on top."""
    return build_llm({**EMBEDDED_MODEL_ENGINE_ARGS, "model": tiny_model_path(), "enforce_eager": True, **overrides})


def generate_token_ids(llm: Any, prompts: list[Any], sampling: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=max_tokens, **entry) for entry in sampling]
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def write_result(result: dict[str, Any]) -> None:
    """Results go to the path given as the script's first argument."""
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1, default=str))


@contextmanager
def patched(owner: Any, name: str, value: Any):
    """`owner.name` replaced by `value` for the block (a fault injected into tracekit or vLLM)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
