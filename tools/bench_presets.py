"""Model shapes the benchmarks under tools/ run with, beside the embedded tiny Llama.

No model hub here: a preset is the tiny model's tokenizer and config with a real model's shapes
laid over it (`hf_overrides`), weights `dummy` (random, seeded). Large enough that what a
benchmark measures (KV copies, compile and graph capture) shows as it would with real weights.
"""

PRESETS = {
    "tiny": {},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 8192},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192, "vocab_size": 128256},
}
# Engine arguments a preset other than tiny runs with (over tracekit's CPU defaults: a KV cache
# of 64 MiB, 8 sequences, float32).
PRESET_ENGINE_ARGS = {"dtype": "bfloat16", "kv_cache_memory_bytes": 16 << 30, "max_model_len": 4096,
                      "max_num_seqs": 64, "max_num_batched_tokens": 8192}


def preset_engine_args(name: str, hf_overrides: dict | None = None) -> dict:
    """The engine arguments that turn the tiny model into preset `name` (none for tiny)."""
    overrides = {**PRESETS[name], **(hf_overrides or {})}
    return {"hf_overrides": overrides, "load_format": "dummy", **PRESET_ENGINE_ARGS} if overrides else {}
