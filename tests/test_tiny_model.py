"""The embedded tiny Llama checkpoint: it matches its generator, and a real vLLM engine runs it.

The first test keeps the shipped files honest (anyone can regenerate them and get the same
bytes); the second proves the checkpoint is what `tracekit record` needs on a machine without a
model hub: vLLM's own safetensors loader and tokenizer accept it, and its greedy outputs depend
on the prompt.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.models import tiny_model_path

GENERATOR = Path(__file__).resolve().parent.parent / "tools" / "make_tiny_model.py"


def test_shipped_files_are_exactly_what_the_generator_writes(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    subprocess.run([sys.executable, str(GENERATOR), str(tmp_path)], check=True)

    shipped_dir = Path(tiny_model_path())
    shipped = sorted(path.name for path in shipped_dir.iterdir())
    generated = sorted(path.name for path in tmp_path.iterdir())
    assert shipped == generated
    for name in generated:
        assert (shipped_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name


@pytest.mark.slow
def test_vllm_loads_the_tiny_model_and_its_greedy_output_depends_on_the_prompt(monkeypatch):
    # In-process engine core (no worker subprocess) and no hub look-ups; both must be set before
    # vLLM is imported.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vllm = pytest.importorskip("vllm")

    llm = vllm.LLM(
        model=tiny_model_path(),
        enforce_eager=True,
        block_size=32,  # the CPU backend needs a multiple of 32
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        # vLLM downcasts float32 checkpoints to bfloat16 unless told otherwise.
        dtype="float32",
        # On CPU the KV cache is otherwise sized from --gpu-memory-utilization (0.92 of the
        # NUMA node's memory), which fails on a busy machine and is far more than needed here.
        kv_cache_memory_bytes=64 * 2**20,
    )
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outputs = llm.generate(["The lighthouse keeper", "Numbers can be added"], greedy)

    bos_token_id = llm.get_tokenizer().bos_token_id
    for output in outputs:
        assert output.prompt_token_ids[0] == bos_token_id
        assert len(output.prompt_token_ids) < 1 + len(output.prompt)  # BPE merges applied
        assert len(output.outputs[0].token_ids) == 8
        # A flat distribution would give every token log(1/512) ≈ -6.2; the argmax stands out.
        first_step = output.outputs[0].logprobs[0]
        top_logprob = max(candidate.logprob for candidate in first_step.values())
        assert top_logprob > math.log(0.1)
    first, second = (output.outputs[0].token_ids for output in outputs)
    assert first != second
