"""Write a tiny MiMo checkpoint with one multi-token-prediction (MTP) layer, for MTP drafting.

MTP drafters are part of their target's checkpoint (vLLM's `{"method": "mtp"}` reads the draft
layers from the target model's own files), so an MTP test needs a target that has them. MiMo is
the smallest architecture vLLM drafts MTP for on CPU (a Qwen2 decoder, `MiMoMTP` over
`num_nextn_predict_layers` extra layers); DeepSeek-V3, ERNIE 4.5 and GLM-4 MoE need MLA or MoE
layers, Qwen3-Next bfloat16 and gated delta-net attention. This writes, loaded through vLLM's
ordinary safetensors path:

  config.json          MiMoForCausalLM (`model_type` qwen2), the embedded tiny Llama's shapes,
                       `num_nextn_predict_layers` 1
  model.safetensors    the embedded model's weights as Qwen2 names them (zero q/k/v biases: the
                       same function), then the MTP layer `model.mtp_layers.0.*`
  tokenizer files      the embedded model's, copied

The MTP layer is made to agree with the target often but not always: its input projection reads
the next token's embedding (plus seeded noise, `--noise`), its decoder block adds nothing (zero
output projections), so it proposes what the target's head makes of that embedding alone — the
target's greedy continuations fall into repetitions it then proposes, and elsewhere it misses.
Dummy weights (`load_format="dummy"`) would reject every draft. Output is byte-identical from
run to run (NumPy's frozen legacy `RandomState` stream, JSON with sorted keys).

Usage: python tools/make_tiny_mtp.py OUTPUT_DIR [--noise X] [--seed N]
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

EMBEDDED = Path(__file__).resolve().parent.parent / "tracekit" / "models" / "tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Qwen2 gives q, k and v projections a bias; the Llama has none.
BIASED = ("q_proj", "k_proj", "v_proj")
DEFAULT_NOISE = 0.5


def mimo_config(llama: dict) -> dict:
    """The embedded Llama's config as MiMo's, with one MTP layer."""
    keep = ("bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "intermediate_size",
            "max_position_embeddings", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings", "torch_dtype", "vocab_size")
    return {**{key: llama[key] for key in keep}, "architectures": ["MiMoForCausalLM"], "model_type": "qwen2",
            "max_window_layers": llama["num_hidden_layers"], "num_nextn_predict_layers": 1,
            "sliding_window": None, "use_sliding_window": False}


def target_tensors(llama: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Llama's weights under Qwen2's names, with zero biases where Qwen2 has them."""
    tensors = dict(llama)
    for name, weight in llama.items():
        if name.rsplit(".", 2)[-2] in BIASED:
            tensors[name.replace(".weight", ".bias")] = np.zeros(weight.shape[0], dtype=weight.dtype)
    return tensors


def mtp_tensors(llama: dict[str, np.ndarray], noise: float, seed: int) -> dict[str, np.ndarray]:
    """MTP layer 0: norms of ones, an input projection that passes the token embedding on (the
    previous hidden state weighted by zero) plus noise, and a decoder block (the target's first
    layer's weights) whose output projections are zero, so it adds nothing to the residual."""
    hidden = llama["model.embed_tokens.weight"].shape[1]
    state = np.random.RandomState(seed)
    projection = np.zeros((hidden, 2 * hidden), dtype=np.float32)
    projection[:, hidden:] = np.eye(hidden, dtype=np.float32)
    projection[:, hidden:] += (state.standard_normal((hidden, hidden)) * noise / np.sqrt(hidden)).astype(np.float32)
    prefix = "model.mtp_layers.0."
    tensors = {
        prefix + "token_layernorm.weight": np.ones(hidden, dtype=np.float32),
        prefix + "hidden_layernorm.weight": np.ones(hidden, dtype=np.float32),
        prefix + "final_layernorm.weight": llama["model.norm.weight"].copy(),
        prefix + "input_proj.weight": projection,
    }
    for name, weight in target_tensors(llama).items():
        if name.startswith("model.layers.0."):
            kept = np.zeros_like(weight) if name.endswith(("o_proj.weight", "down_proj.weight")) else weight
            tensors[prefix + name.removeprefix("model.layers.0.")] = kept
    return tensors


def write(output: Path, noise: float, seed: int) -> None:
    output.mkdir(parents=True, exist_ok=True)
    llama_config = json.loads((EMBEDDED / "config.json").read_text())
    llama = load_file(str(EMBEDDED / "model.safetensors"))
    (output / "config.json").write_text(json.dumps(mimo_config(llama_config), indent=2, sort_keys=True) + "\n")
    tensors = {**target_tensors(llama), **mtp_tensors(llama, noise, seed)}
    save_file(dict(sorted(tensors.items())), str(output / "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copyfile(EMBEDDED / name, output / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--noise", type=float, default=DEFAULT_NOISE,
                        help="scale of the noise on the MTP layer's input projection (0: it agrees most)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.output, args.noise, args.seed)


if __name__ == "__main__":
    main()
