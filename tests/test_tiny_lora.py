"""tools/make_tiny_lora.py: a tiny random peft adapter for the embedded model, the same bytes
every run, in the shape vLLM's own peft reader accepts (the LoRA end-to-end tests load it into
real engines)."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.numpy import load_file

from tracekit.integrations.vllm.records.weights import adapter_fingerprint
from tracekit.models import tiny_model_path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "make_tiny_lora.py"


def make(folder: Path, *args: str) -> Path:
    subprocess.run([sys.executable, str(TOOL), str(folder), *args], check=True, capture_output=True)
    return folder


def test_the_same_seed_writes_the_same_adapter_and_another_seed_another(tmp_path):
    first, again, other = make(tmp_path / "a", "--seed", "1"), make(tmp_path / "b", "--seed", "1"), make(tmp_path / "c")
    assert adapter_fingerprint(first) == adapter_fingerprint(again) != adapter_fingerprint(other)


def test_vllm_reads_it_as_a_rank_8_adapter_of_every_projection_of_both_layers(tmp_path):
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    folder = make(tmp_path / "adapter", "--rank", "8")
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=2048)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    assert (helper.r, helper.lora_alpha) == (8, 16)
    model = json.loads((Path(tiny_model_path()) / "config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(helper.target_modules) == projections
    assert len(tensors) == 2 * len(projections) * model["num_hidden_layers"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (8, model["hidden_size"])
    assert tensors[f"{q}.lora_B.weight"].shape == (model["num_attention_heads"] * model["head_dim"], 8)
