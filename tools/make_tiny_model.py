"""Generate the tiny Llama checkpoint embedded in tracekit (`tracekit/models/tiny-llama/`).

tracekit must be able to record a real engine step on a fresh machine that has no model hub, so
the package ships a checkpoint of its own. vLLM's `load_format="dummy"` is no substitute: its
weights are so small that every logit comes out near 0.02 and greedy decoding ignores the prompt.
This script writes a checkpoint that vLLM loads through its ordinary safetensors path:

  config.json               LlamaForCausalLM, 2 layers, hidden 128, grouped-query attention
  model.safetensors         weights named as Hugging Face names them, drawn from a seeded normal
  tokenizer.json            byte-level BPE with 512 tokens, trained on the text in this file
  tokenizer_config.json     PreTrainedTokenizerFast, special tokens, a minimal chat template
  generation_config.json    bos/eos ids, so vLLM finds no other defaults to apply

The weights are scaled so every layer keeps unit-scale activations (std 1/sqrt(fan_in)) and the
logits spread over a few units, so greedy outputs depend on the prompt. Output is byte-identical
from run to run: the weights come from NumPy's legacy `RandomState` stream, which NumPy keeps
frozen across releases, and every JSON file is written with sorted keys.
tests/test_tiny_model.py regenerates the checkpoint and compares it byte for byte with the
shipped files.

Usage: python tools/make_tiny_model.py [OUTPUT_DIR]   (default: tracekit/models/tiny-llama)
"""

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent.parent / "tracekit" / "models" / "tiny-llama"

SEED = 20240613
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_ATTENTION_HEADS = 2
NUM_KEY_VALUE_HEADS = 1
HEAD_DIM = 64  # vLLM's CPU attention kernels support 64 but not smaller head sizes
INTERMEDIATE_SIZE = 256
VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 2048
EMBEDDING_STD = 1.0
LOGIT_STD = 4.0

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2 as in Llama tokenizers
UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

TRAINING_TEXT = """\
The lighthouse keeper woke before dawn, as he had done every morning for thirty years. He climbed
the narrow stairs, trimmed the wick, and watched the grey water turn silver in the first light.
Ships passed far out on the horizon, and he wrote their names in a small book with a blue cover.
In the afternoon he walked along the cliffs, gathering driftwood for the stove and listening to
the gulls argue over scraps of fish. When storms came he stayed awake through the night, because
a single dark hour could cost a crew their lives.

A computer program is a list of instructions that a machine follows one step at a time. Each step
reads some numbers, changes them, and writes the result somewhere else. Modern processors run
billions of these steps every second, yet they still do only what they are told. When a program
is wrong, the machine does not notice; it simply follows the wrong instructions very quickly.
Good engineers therefore write tests, measure what their code does, and keep a record of every
change so that a mistake made today can be found and fixed tomorrow.

Language models read text as a sequence of tokens. A token may be a whole word, a piece of a
word, or a single letter. The model looks at the tokens it has seen so far and predicts which
token should come next. Repeating this prediction many times produces a sentence, a paragraph,
or a whole story. Inside the model, every token becomes a vector of numbers, and each layer mixes
these vectors through attention and a small feed forward network before passing them on.

The market in the old town opened at seven. Farmers brought apples, pears, potatoes, onions,
cabbages, and fresh bread still warm from the oven. Children ran between the stalls while their
parents counted coins and argued cheerfully about the price of cheese. By noon the square was
full of voices, music, and the smell of roasted chestnuts. In the evening the stalls were folded
away, the stones were swept clean, and the pigeons returned to search for the last crumbs.

Water boils at one hundred degrees Celsius at sea level, but at the top of a high mountain it
boils at a lower temperature because the air pressure is weaker. This is why cooking pasta in the
mountains takes longer. Salt raises the boiling point only a little, so adding it to the pot is
mostly a matter of taste. Ice floats because it is less dense than liquid water, which keeps
lakes from freezing solid in winter and lets fish survive beneath the frozen surface.

She opened the letter slowly and read it twice. The words were simple, but their meaning was
not. Her grandmother had left her the house by the river, the garden with its crooked apple
trees, and a wooden box that nobody had been allowed to open. That night she sat by the window
with the box on her knees, listening to the rain, and wondered what secrets it might hold.

Numbers can be added, subtracted, multiplied, and divided. One plus one is two. Two times three
is six. Ten divided by five is two. A prime number can be divided only by one and by itself, and
the first few primes are two, three, five, seven, eleven, and thirteen. Mathematicians have
proved that there are infinitely many primes, although they become rarer as numbers grow larger.
"""


def main() -> None:
    output_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUTPUT_DIR
    write_tiny_model(output_dir)
    for path in sorted(output_dir.iterdir()):
        print(f"{path.stat().st_size:>10,}  {path}")


def write_tiny_model(output_dir: Path) -> None:
    """Write every file of the checkpoint into `output_dir`, replacing any previous ones."""
    output_dir.mkdir(parents=True, exist_ok=True)
    _write_json(output_dir / "config.json", model_config())
    _write_json(output_dir / "generation_config.json", generation_config())
    save_file(model_weights(), str(output_dir / "model.safetensors"))
    tokenizer = train_tokenizer()
    (output_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n")
    _write_json(output_dir / "tokenizer_config.json", tokenizer_config())


def model_config() -> dict:
    rope_theta = 10000.0
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE_SIZE,
        "hidden_act": "silu",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        # Older transformers read `rope_theta`; 5.x reads `rope_parameters`.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}


def model_weights() -> dict[str, np.ndarray]:
    """Weights in Hugging Face Llama naming, drawn in a fixed order from one seeded stream.

    Projections use std 1/sqrt(fan_in) so activations stay near unit scale through both layers;
    the lm_head uses LOGIT_STD/sqrt(hidden) so that, after the final RMSNorm, logits have a
    standard deviation of about LOGIT_STD and a clear argmax.
    """
    random_state = np.random.RandomState(SEED)

    def normal(shape: tuple[int, int], std: float) -> np.ndarray:
        return (random_state.standard_normal(shape) * std).astype(np.float32)

    def projection(out_features: int, in_features: int) -> np.ndarray:
        return normal((out_features, in_features), in_features**-0.5)

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    weights = {"model.embed_tokens.weight": normal((VOCAB_SIZE, HIDDEN_SIZE), EMBEDDING_STD)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.input_layernorm.weight": ones(HIDDEN_SIZE),
            f"{prefix}.self_attn.q_proj.weight": projection(
                NUM_ATTENTION_HEADS * HEAD_DIM, HIDDEN_SIZE
            ),
            f"{prefix}.self_attn.k_proj.weight": projection(
                NUM_KEY_VALUE_HEADS * HEAD_DIM, HIDDEN_SIZE
            ),
            f"{prefix}.self_attn.v_proj.weight": projection(
                NUM_KEY_VALUE_HEADS * HEAD_DIM, HIDDEN_SIZE
            ),
            f"{prefix}.self_attn.o_proj.weight": projection(
                HIDDEN_SIZE, NUM_ATTENTION_HEADS * HEAD_DIM
            ),
            f"{prefix}.post_attention_layernorm.weight": ones(HIDDEN_SIZE),
            f"{prefix}.mlp.gate_proj.weight": projection(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.up_proj.weight": projection(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.down_proj.weight": projection(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    weights["model.norm.weight"] = ones(HIDDEN_SIZE)
    weights["lm_head.weight"] = normal((VOCAB_SIZE, HIDDEN_SIZE), LOGIT_STD * HIDDEN_SIZE**-0.5)
    return weights


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE (every string encodes, no unknowns) that prepends BOS like Llama's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
