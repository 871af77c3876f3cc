"""The KV layout check between a recorded attention backend and this engine's (no engine here:
the strings are what `platform_facts.attention_backend` reads from vLLM's attention layers)."""

from tracekit.integrations.vllm.engines.platform_facts import kv_layout_difference


def test_amx_and_vec_cpu_attention_cannot_read_each_others_kv_blocks():
    assert "CPU_ATTN/amx" in kv_layout_difference("CPU_ATTN/amx", "CPU_ATTN/vec")
    assert kv_layout_difference("CPU_ATTN/vec", "CPU_ATTN/amx") is not None


def test_same_layout_or_an_unknown_backend_is_no_refusal():
    assert kv_layout_difference("CPU_ATTN/vec", "CPU_ATTN/vec16") is None
    assert kv_layout_difference(None, "CPU_ATTN/amx") is None  # bundles before the field
    assert kv_layout_difference("FLASH_ATTN", "FLASHINFER") is None
