"""The tiny Llama checkpoint that ships inside tracekit.

`tracekit record` needs a real model to start a real engine, and a fresh machine (a CI runner, an
air-gapped box, a laptop) may have no model hub to download one from. So the package carries its
own: `tiny-llama/` is a 2-layer LlamaForCausalLM (hidden 128, grouped-query attention, 512-token
byte-level BPE tokenizer, about 1.7 MB of float32 safetensors) that vLLM loads through its
ordinary safetensors loader, so a recorded step exercises the same load and forward paths as a
production model. Its weights are random but scaled so logits spread over several units and
greedy outputs depend on the prompt, unlike `load_format="dummy"`, whose logits are all ≈ 0.02.

The files are generated, not trained: tools/make_tiny_model.py writes them deterministically, and
tests/test_tiny_model.py checks that the shipped files are byte-identical to its output.
"""

from pathlib import Path

_TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny-llama"


def tiny_model_path() -> str:
    """Absolute path of the embedded checkpoint, usable as vLLM's `model=` and `tokenizer=`."""
    return str(_TINY_MODEL_DIR)
