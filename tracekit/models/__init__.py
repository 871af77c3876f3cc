"""The tiny Llama checkpoint that ships inside tracekit, so that `tracekit record` starts a real
engine on a machine with no model hub to download one from (a CI runner, an air-gapped box).

tools/make_tiny_model.py writes `tiny-llama/` deterministically and says what it is and why not
`load_format="dummy"`; tests/test_tiny_model.py checks the shipped files are its output.
"""

from pathlib import Path


def tiny_model_path() -> str:
    """Absolute path of the embedded checkpoint, usable as vLLM's `model=` and `tokenizer=`."""
    return str(Path(__file__).resolve().parent / "tiny-llama")
