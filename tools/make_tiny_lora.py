"""Write a tiny random LoRA adapter (peft format) for the embedded tiny Llama.

A LoRA replay test needs an adapter the machine has without a model hub. This writes one that
vLLM loads through its ordinary peft path (`PEFTHelper` + `LoRAModel.from_local_checkpoint`):

  adapter_config.json        peft's LoRA config: rank, alpha, the target modules
  adapter_model.safetensors  lora_A [rank, in] and lora_B [out, rank] of every target module of
                             both layers, named as peft names them
                             (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)

The weights are drawn from a seeded normal, scaled so the adapter moves the logits by about a
unit and greedy tokens change; a different `--seed` gives a different adapter. Output is
byte-identical from run to run (NumPy's frozen legacy `RandomState` stream, JSON with sorted keys).

Usage: python tools/make_tiny_lora.py OUTPUT_DIR [--seed N] [--rank R]
"""

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# The embedded model's shapes (tools/make_tiny_model.py).
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
Q_SIZE = 2 * 64  # attention heads x head dim
KV_SIZE = 1 * 64  # key-value heads x head dim
# target module -> (parent module, input size, output size)
TARGETS = {
    "q_proj": ("self_attn", HIDDEN_SIZE, Q_SIZE),
    "k_proj": ("self_attn", HIDDEN_SIZE, KV_SIZE),
    "v_proj": ("self_attn", HIDDEN_SIZE, KV_SIZE),
    "o_proj": ("self_attn", Q_SIZE, HIDDEN_SIZE),
    "gate_proj": ("mlp", HIDDEN_SIZE, INTERMEDIATE_SIZE),
    "up_proj": ("mlp", HIDDEN_SIZE, INTERMEDIATE_SIZE),
    "down_proj": ("mlp", INTERMEDIATE_SIZE, HIDDEN_SIZE),
}
DEFAULT_RANK = 8
ALPHA_PER_RANK = 2  # lora_alpha = 2 * rank: vLLM scales B @ A by alpha / rank = 2
# Each element of lora_A @ x has std A_STD (x of unit scale), each of lora_B @ (lora_A @ x) std
# A_STD * B_STD: times alpha / rank, the adapter adds about 0.5 to activations of unit scale.
A_STD = 1.0
B_STD = 0.25


def adapter_tensors(seed: int, rank: int) -> dict[str, np.ndarray]:
    state = np.random.RandomState(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for name, (parent, fan_in, fan_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            scale_a = A_STD / np.sqrt(fan_in)
            scale_b = B_STD / np.sqrt(rank)
            tensors[f"{prefix}.lora_A.weight"] = (state.standard_normal((rank, fan_in)) * scale_a).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (state.standard_normal((fan_out, rank)) * scale_b).astype(np.float32)
    return tensors


def adapter_config(rank: int) -> dict:
    return {
        "base_model_name_or_path": "tracekit-tiny-llama",
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_alpha": ALPHA_PER_RANK * rank,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "target_modules": sorted(TARGETS),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def write_adapter(output: Path, seed: int = 0, rank: int = DEFAULT_RANK) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(seed, rank), str(output / "adapter_model.safetensors"))
    (output / "adapter_config.json").write_text(json.dumps(adapter_config(rank), indent=1, sort_keys=True) + "\n")
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK)
    arguments = parser.parse_args()
    print(write_adapter(arguments.output, arguments.seed, arguments.rank))
