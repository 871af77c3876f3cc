"""The typed content of a bundle: what a recorded engine step holds, defined once.

docs/FORMAT.md ("Content schema") is the field-by-field reference, with how unknown and missing
fields are read; this is the code. Each field's annotation is its type in the file, checked by
`tracekit.format.typecheck`, so a stranger's wrong value is one `BundleError` line naming its
place, never a crash later on. Tensor fields hold a `torch.Tensor` while recording, a
`{"$tensor": name}` reference in the file, and what `BundleReader.resolve` loads when replaying.
"""

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, ClassVar, TypedDict

from tracekit.errors import BundleError
from tracekit.format.typecheck import INT64_MAX, NOT_IN_FILE, Range, Tensor, convert, in_file, record_fields, wrong_type

SCHEMA_VERSION = 2  # 2: a request's runner-specific state is one map (`RequestState.from_plain` moves 1's)

# vLLM holds token ids, token counts and block ids as int32.
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
Count = Annotated[int, Range(0, INT32_MAX)]  # of tokens, blocks, warm-ups, threads, steps
Size = Annotated[int, Range(1, INT32_MAX)]  # a divisor: tokens per KV block
TokenId = Annotated[int, Range(INT32_MIN, INT32_MAX)]  # below 0: a placeholder (V1 under async scheduling)
BlockId = Annotated[int, Range(0, INT32_MAX)]
MAX_WORLD_SIZE = 4096  # ranks of one multi-rank engine
Ranks = Annotated[int, Range(1, MAX_WORLD_SIZE)]
Rank = Annotated[int, Range(0, MAX_WORLD_SIZE - 1)]


@dataclass
class SchemaRecord:
    """Base: plain-data conversion that keeps unknown fields and checks every field's type."""

    extras: dict[str, Any] = field(default_factory=dict, kw_only=True, metadata=NOT_IN_FILE)

    def to_plain(self) -> dict[str, Any]:
        plain: dict[str, Any] = dict(self.extras)
        for item in dataclasses.fields(self):
            if not in_file(item):
                continue
            value = getattr(self, item.name)
            if isinstance(value, SchemaRecord):
                value = value.to_plain()
            elif isinstance(value, list) and value and isinstance(value[0], SchemaRecord):
                value = [entry.to_plain() for entry in value]
            plain[item.name] = value
        return plain

    @classmethod
    def from_plain(cls, data: Any, where: str = "") -> "SchemaRecord":
        """The record of a plain map, each known field checked against its annotation (in
        declared order, so the first problem named is always the same); `where` is its place."""
        where = where or cls.__name__
        if type(data) is not dict:
            raise wrong_type(where, cls, data)
        fields = record_fields(cls)
        values = {name: convert(data[name], annotation, f"{where}.{name}")
                  for name, annotation in fields.items() if name in data}
        missing = [item.name for item in dataclasses.fields(cls)
                   if item.name in fields and item.name not in values and default_of(item) is dataclasses.MISSING]
        if missing:
            raise BundleError(f"bundle content: {where} lacks required field(s) {', '.join(missing)}")
        extras = {key: value for key, value in data.items() if key not in fields}
        record = cls(**values, extras=extras)
        record.check_values(where)
        return record

    def check_values(self, where: str) -> None:
        """Rules between fields that no annotation can state, checked once a record of a
        bundle is built (a `BundleError` naming `where` if one breaks): the values a replay
        would otherwise index or size with, later, inside vLLM."""


def default_of(item: dataclasses.Field) -> Any:
    """The value a record's field takes where a bundle lacks it; `dataclasses.MISSING`: none."""
    return item.default if item.default_factory is dataclasses.MISSING else item.default_factory()


@dataclass
class Environment(SchemaRecord):
    """Where a bundle was recorded; compared field by field before a replay."""

    tracekit_version: str
    vllm_version: str | None = None
    torch_version: str | None = None
    python_version: str | None = None
    platform: str | None = None  # e.g. "Linux-6.1-x86_64"
    device_kind: str = "cpu"  # "cpu", "cuda" or "npu"
    device_name: str | None = None
    cpu_isa: str | None = None  # e.g. "avx512_bf16" / "avx2"
    gpu_capability: str | None = None  # e.g. "sm_90"
    attention_backend: str | None = None  # vLLM's attention backend(s), e.g. "CPU_ATTN"
    num_threads: Count | None = None  # torch intra-op threads (CPU reductions may split by them)
    env_vars: dict[str, str] = field(default_factory=dict)  # VLLM_*, TRACEKIT_*, CUDA_* ...
    env_prefixes: list[str] | None = None  # whose variables `env_vars` holds: others are unknown


@dataclass
class ModelInfo(SchemaRecord):
    path: str
    architecture: str | None = None
    weights_fingerprint: str | None = None  # hash over the weight files' names and bytes


@dataclass
class KernelCopy(SchemaRecord):
    """One copy of an autotuned Triton kernel, told apart from the other copies of its source by
    where a compiled graph's module binds it (`tracekit.graphs.kernel_choices`)."""

    graph: str
    binding: str
    config: dict[str, Count]


@dataclass
class KernelChoice(SchemaRecord):
    """The launch configuration one autotuned Triton kernel ran with (docs/FORMAT.md, "EngineConfig")."""

    kernel: str
    source_hash: str
    config: dict[str, Count]
    origin: str = ""  # "timed" (autotuned in that process) or "autotune_cache" (found in Inductor's cache)
    other_configs: list[dict[str, Count]] = field(default_factory=list)
    copies: list[KernelCopy] = field(default_factory=list)


@dataclass
class EngineConfig(SchemaRecord):
    """What is needed to rebuild the engine, the KV cache geometry the block ids live in included."""

    vllm_version: str
    engine_args: dict[str, Any]
    model: ModelInfo
    num_kv_blocks: Count
    block_size: Size
    runner: str = "v1"  # which vLLM model runner recorded the step: "v1" or "v2"
    kernel_choices: list[KernelChoice] = field(default_factory=list)
    draft_model: ModelInfo | None = None  # a speculative decoding engine's draft model (EAGLE, ...)


class RunnerState(TypedDict, total=False):
    """What only the recording runner kind keeps per request, by name (other names are kept as
    they are: a newer tracekit may keep more)."""

    generator_state: Tensor  # V1: a seeded request's torch.Generator state
    seed: int  # V2: its sampling seed (drawn at random when the request set none)
    prefill_len: Count  # V2: the tokens the runner was given when the request was added
    draft_probs: Tensor  # V1, probabilistic drafting: the drafter's probabilities, [drafts, vocab]
    draft_logits: Tensor  # V2: its logits (before temperature)


@dataclass
class RequestState(SchemaRecord):
    """The runner's view of one request at the recorded step (batch order is `Step.batch_order`)."""

    req_id: str
    prompt_token_ids: list[TokenId]
    output_token_ids: list[TokenId]
    block_ids: list[list[BlockId]]  # one list per KV cache group
    num_computed_tokens: Count
    num_scheduled_tokens: Count
    sampling_params: "SamplingParamsRecord | None" = None
    runner_state: RunnerState = field(default_factory=dict)
    draft_token_ids: list[TokenId] = field(default_factory=list)  # those this step verifies
    lora_adapter: str | None = None  # the name of the LoRA adapter it runs with (`Step.lora_adapters`)

    _VERSION_1_RUNNER_FIELDS: ClassVar[tuple[str, ...]] = ("generator_state", "seed", "prefill_len")

    @property
    def is_prefill(self) -> bool:
        return is_prefill(self.num_computed_tokens, len(self.prompt_token_ids), len(self.output_token_ids))

    @property
    def samples(self) -> bool:
        """Whether the step samples a token for it: its scheduled tokens reach the end of those it
        knows (a prefill chunk that stops short samples nothing)."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        return self.num_computed_tokens + self.num_scheduled_tokens >= known

    @classmethod
    def from_plain(cls, data: Any, where: str = "") -> "RequestState":
        """Schema version 1's runner fields moved into `runner_state` (a runner state that is
        not a map is left for the type check to refuse), then read as any record."""
        if type(data) is dict and any(name in data for name in cls._VERSION_1_RUNNER_FIELDS):
            data = dict(data)
            moved = {name: data.pop(name) for name in cls._VERSION_1_RUNNER_FIELDS if name in data}
            kept = data.get("runner_state", {})
            if type(kept) is dict:
                data["runner_state"] = {**{k: v for k, v in moved.items() if v is not None}, **kept}
        return super().from_plain(data, where)


def token_runs(requests: list[RequestState]) -> list[range]:
    """Each request's run of a step's token rows: requests in batch order, each one's scheduled
    tokens a run of the flattened inputs."""
    runs, offset = [], 0
    for request in requests:
        runs.append(range(offset, offset + request.num_scheduled_tokens))
        offset += request.num_scheduled_tokens
    return runs


def draft_rows(run: range, num_drafts: int) -> range:
    """The rows of a drafted request's run that hold its drafts: the last `num_drafts`, after its
    last sampled token."""
    return range(run.stop - num_drafts, run.stop)


def is_prefill(num_computed_tokens: int, num_prompt_tokens: int, num_output_tokens: int) -> bool:
    """The one definition of a prefill: a request prefills while the runner computes tokens it
    already had rather than the one it sampled last, that is its prompt or, when it resumes
    after preemption, its prompt and earlier outputs. A decode computes only its newest token."""
    return num_computed_tokens < num_prompt_tokens + max(num_output_tokens - 1, 0)


@dataclass
class RecordedObject(SchemaRecord):
    """A vLLM object as recorded (docs/FORMAT.md, "vLLM objects"): the fields tracekit reads typed,
    any other kept in `extras`; tagged sets and tuples are lists here (`TAGS`: field -> its tag,
    "[$tuple]" of each element). Written back, it holds the fields it was read with, in their
    order, and any field given a value other than its default since."""

    TAGS: ClassVar[dict[str, str]] = {}
    read_keys: tuple[str, ...] | None = field(default=None, kw_only=True, compare=False, repr=False,
                                              metadata=NOT_IN_FILE)

    @classmethod
    def from_plain(cls, data: Any, where: str = "") -> "RecordedObject":
        if type(data) is dict:
            data = {key: _untagged(value, cls.TAGS.get(key)) for key, value in data.items()}
        record = super().from_plain(data, where)
        record.read_keys = tuple(data)
        return record

    def to_plain(self) -> dict[str, Any]:
        plain = super().to_plain()
        for name, tag in self.TAGS.items():
            plain[name] = _tagged(plain[name], tag)
        if self.read_keys is None:
            return plain
        changed = [item.name for item in dataclasses.fields(self) if in_file(item) and item.name not in self.read_keys
                   and getattr(self, item.name) != default_of(item)]
        return {key: plain[key] for key in [*self.read_keys, *changed, *self.extras] if key in plain}


def _untagged(value: Any, tag: str | None) -> Any:
    """A recorded value without its tag (anything else is left for the type check)."""
    if tag is not None and tag.startswith("[") and type(value) is list:
        return [_untagged(item, tag[1:-1]) for item in value]
    return value[tag] if tag is not None and type(value) is dict and list(value) == [tag] else value


def _tagged(value: Any, tag: str | None) -> Any:
    if tag is None or value is None:
        return value
    return [_tagged(item, tag[1:-1]) for item in value] if tag.startswith("[") else {tag: value}


BlockGroups = list[list[BlockId]]  # a vLLM tuple of block id lists, one per KV cache group


@dataclass
class NewRequestRecord(RecordedObject):
    """vLLM's `NewRequestData`: a request the scheduler hands the runner whole."""

    TAGS: ClassVar[dict[str, str]] = {"block_ids": "$tuple"}
    req_id: str
    prompt_token_ids: list[TokenId] | None = None  # None: the prompt came as embeddings
    prefill_token_ids: list[TokenId] | None = None  # prompt and outputs (a resumed request's, V2)
    block_ids: BlockGroups = field(default_factory=list)
    num_computed_tokens: Count = 0
    sampling_params: "SamplingParamsRecord | None" = None
    lora_request: "LoRARequestRecord | None" = None
    mm_features: Any = None  # multimodal inputs
    prompt_embeds: Any = None  # a tensor
    pooling_params: Any = None


@dataclass
class LoRARequestRecord(RecordedObject):
    """vLLM's `LoRARequest`: the adapter a request runs with."""

    lora_name: str | None = None


@dataclass
class SamplingParamsRecord(RecordedObject):
    """vLLM's `SamplingParams`, typed where it decides whether a draw is reproducible or makes
    sampling read token ids beyond those the step computes (`records.step_records`)."""

    temperature: float = 1.0
    seed: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[TokenId]] | None = None
    thinking_token_budget: int | None = None
    stop: str | list[str] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: Any = None  # a tagged vLLM StructuredOutputsParams


@dataclass
class CachedRequestsRecord(RecordedObject):
    """vLLM's `CachedRequestData`: what changed of the requests the runner holds, a column per
    field, a row per request of `req_ids` (`resumed_req_ids` and `all_token_ids`: vLLM 0.26-0.32)."""

    TAGS: ClassVar[dict[str, str]] = {"resumed_req_ids": "$set", "new_block_ids": "[$tuple]"}
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[TokenId]] = field(default_factory=list)  # pipeline parallel, async: else empty
    all_token_ids: dict[str, list[TokenId]] = field(default_factory=dict)
    new_block_ids: list[BlockGroups | None] = field(default_factory=list)  # None: no new blocks
    num_computed_tokens: list[Count] = field(default_factory=list)
    num_output_tokens: list[Count] = field(default_factory=list)

    COLUMNS: ClassVar[tuple[str, ...]] = ("new_block_ids", "num_computed_tokens", "num_output_tokens")

    def check_values(self, where: str) -> None:
        for name in self.COLUMNS:
            if len(getattr(self, name)) != len(self.req_ids):
                raise BundleError(f"bundle content: {where}.{name} should hold one entry per request of req_ids "
                                  f"({len(self.req_ids)}), not {len(getattr(self, name))}")


@dataclass
class SchedulerOutputRecord(RecordedObject):
    """vLLM's `SchedulerOutput`: what the scheduler handed the runner for one step."""

    TAGS: ClassVar[dict[str, str]] = {"finished_req_ids": "$set", "preempted_req_ids": "$set"}
    scheduled_new_reqs: list[NewRequestRecord] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestsRecord = field(default_factory=CachedRequestsRecord)
    num_scheduled_tokens: dict[str, Count] = field(default_factory=dict)  # in the runner's batch order
    total_num_scheduled_tokens: Count = 0
    scheduled_spec_decode_tokens: dict[str, list[TokenId]] = field(default_factory=dict)  # the drafts each verifies
    scheduled_encoder_inputs: dict[str, Any] = field(default_factory=dict)
    num_common_prefix_blocks: list[Count] = field(default_factory=list)  # cascade attention, per KV group
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] | None = None
    num_invalid_spec_tokens: dict[str, Count] | None = None
    new_block_ids_to_zero: list[BlockId] | None = None
    num_spec_tokens_to_schedule: Count | None = None  # how many drafts to propose after the step
    skip_drafts: bool | None = None  # vLLM 0.34: propose none after the step

    def new_request(self, req_id: str) -> NewRequestRecord | None:
        return next((entry for entry in self.scheduled_new_reqs if entry.req_id == req_id), None)

    @property
    def outside_the_batch(self) -> set[str]:
        """Request ids of requests outside the batch that it names (finished or preempted)."""
        return {*self.finished_req_ids, *(self.preempted_req_ids or ())}


@dataclass
class KVLayout(SchemaRecord):
    """How one layer's KV cache tensor is laid out: blocks are slices along `block_dim`."""

    shape: list[Count]
    dtype: str
    block_dim: Count
    num_blocks: Count
    block_size: Size

    def check_values(self, where: str) -> None:
        if self.block_dim >= len(self.shape):
            raise BundleError(f"bundle content: {where}.block_dim {self.block_dim} is no dimension of shape {self.shape}")


def blocks_covering(tokens: int, block_size: int) -> int:
    """How many KV blocks of `block_size` slots the first `tokens` tokens of a request fill."""
    return -(-tokens // block_size)


@dataclass
class KVGroupSnapshot(SchemaRecord):
    """One KV cache group: its layers, the blocks saved, and those blocks' contents."""

    layer_names: list[str]
    layout: KVLayout
    read_block_ids: list[BlockId]
    written_block_ids: list[BlockId]
    saved_block_ids: list[BlockId]  # the rows of every `before` tensor, in this order
    before: dict[str, Tensor] = field(default_factory=dict)  # layer -> tensor, pre-forward
    after: dict[str, Tensor] = field(default_factory=dict)  # layer -> tensor of written blocks


class KVMode(str, Enum):
    """Which KV blocks a bundle saves (`KVSnapshot.mode`)."""

    READ = "read"  # every block the forward reads: it replays exactly
    WRITTEN = "written"  # only those it writes
    NONE = "none"
    RECOMPUTE = "recompute"  # none: the replay prefills each request's recorded tokens


KV_MODES = tuple(mode.value for mode in KVMode)


@dataclass
class KVSnapshot(SchemaRecord):
    mode: str  # a `KVMode`: any str is read (a replay refuses a mode it does not know, exit 3)
    groups: list[KVGroupSnapshot] = field(default_factory=list)
    taken: str = "before_forward"  # when `before` was copied, or "after_step" (event triggers)


class BatchDescriptor(TypedDict, total=False):
    """The runner's tagged batch descriptor (vLLM's `BatchDescriptor`, or V2's
    `BatchExecutionDescriptor`): the one field tracekit reads; the others are vLLM's, kept."""

    num_tokens: Count  # the dispatcher's key: the graph's padded size


@dataclass
class GraphDispatch(SchemaRecord):
    """The engine's capture-size tables and what this step was dispatched to, as the platform
    reported them (on CPU: no graphs, `runtime_mode` "NONE")."""

    compilation_mode: str
    cudagraph_mode: str
    capture_sizes: list[Count] = field(default_factory=list)
    compile_sizes: list[Count] = field(default_factory=list)
    max_capture_size: Count | None = None
    num_warmups: Count | None = None
    splitting_ops: list[str] = field(default_factory=list)
    runtime_mode: str = "NONE"
    num_tokens: Count = 0  # the tokens scheduled: the step's real rows
    num_tokens_padded: Count = 0  # the rows the forward ran (a graph's padded size); the rest is padding
    batch_descriptor: BatchDescriptor | None = None
    attention: dict[str, Any] | None = None  # what the attention metadata builder decided


@dataclass
class StepOutputs(SchemaRecord):
    # `record --layers`: module name -> output, in forward order (first in the file so that a
    # diff meets them before the final hidden states they lead to)
    layers: dict[str, Tensor] = field(default_factory=dict)
    hidden_states: Tensor | None = None  # [num_tokens_padded, hidden]
    logits: Tensor | None = None  # [num_sampled, vocab], as the model computed them (before any grammar mask)
    grammar_bitmask: Tensor | None = None  # the mask as it reached the logits (`records.grammar.applied_mask`)
    sampled_token_ids: list[list[TokenId]] | None = None  # per request, batch order
    finite: bool = True


@dataclass
class GrammarRecord(SchemaRecord):
    """The structured-output grammar mask of a step, as it reached the runner's `sample_tokens`
    (vLLM's `GrammarOutput`, which the scheduler sends apart from the scheduler output)."""

    request_ids: list[str]  # the requests sampling under a grammar, in the order of the bitmask rows
    rows_per_request: list[Size]  # the rows each owns: 1 + its drafts this step
    bitmask: Tensor  # int32 [sum(rows_per_request), ceil(vocab / 32)]: bit j of word i set = token 32i+j allowed
    num_acceptable_drafts: list[Count] | None = None  # per request: leading drafts the mask constrained

    def check_values(self, where: str) -> None:
        counts = [len(self.rows_per_request)]
        if self.num_acceptable_drafts is not None:
            counts.append(len(self.num_acceptable_drafts))
        if any(count != len(self.request_ids) for count in counts):
            raise BundleError(f"bundle content: {where} should hold rows_per_request (and num_acceptable_drafts) "
                              "for each of its request_ids")

    def rows_of(self, req_id: str) -> range:
        """The bitmask rows of one request."""
        start = 0
        for owner, count in zip(self.request_ids, self.rows_per_request):
            if owner == req_id:
                return range(start, start + count)
            start += count
        return range(0)


@dataclass
class StepTiming(SchemaRecord):
    forward_us: float | None = None  # the model call in the engine, timed as `forward_timer` says
    forward_timer: str | None = None  # "device_events_queued", "device_events", "perf_counter" (docs/FORMAT.md)
    forward_cpu_us: float | None = None  # process CPU time of that forward
    step_us: float | None = None  # wall time of execute_model + sample_tokens
    host_copy_us: float | None = None  # the recorder's stall: copying the step to host
    device_copy_us: float | None = None  # how long the step's copies held their side stream
    first_of_its_size: bool | None = None  # may hold one-time costs (compilation, autotuning)


@dataclass
class DrafterPass(SchemaRecord):
    """One model call of a speculative drafter (EAGLE, ...) in the recorded step, as the call saw
    it (padded where the drafter runs at a graph's size; the step's rows: `Step.drafter_rows`)."""

    input_ids: Tensor | None = None
    positions: Tensor | None = None
    hidden_states_in: Tensor | None = None  # the target's hidden states it read (EAGLE3: combined)
    hidden_states: Tensor | None = None  # its output


@dataclass
class SpecDecodeRecord(SchemaRecord):
    """Speculative decoding in the recorded step (the drafts each request verifies are in its
    `RequestState.draft_token_ids`): the method, and what the drafter did in this step."""

    method: str  # vLLM's speculative method: "ngram", "eagle", "eagle3", ...
    num_speculative_tokens: Count
    # [requests in batch order, proposed] for the next step, -1 where fewer; None: not taken
    proposals: Tensor | None = None
    drafter_calls: list[DrafterPass] = field(default_factory=list)  # its model calls, in order
    padded_drafter_batch: bool = True  # False: vLLM's `disable_padded_drafter_batch`


class StepError(TypedDict, total=False):
    """How a recorded step raised."""

    type: str
    message: str
    traceback: str
    phase: str  # where: "prepare", "forward", "logits", "sampling" or "bookkeeping"


class RunnerCall(str, Enum):
    """A model runner call a window records, in the order the engine made it (`StepWindow.calls`)."""

    EXECUTE = "execute"  # execute_model: the scheduler output applied, the forward run
    SAMPLE = "sample"  # sample_tokens
    OUTPUT = "output"  # the engine read the step's output (under async scheduling, after later calls)


RUNNER_CALLS = tuple(call.value for call in RunnerCall)


class WindowCall(TypedDict):
    """One call of `StepWindow.calls`: which, of which step (its engine step index)."""

    call: str  # a `RunnerCall`
    step: Count


@dataclass
class KVWritten(SchemaRecord):
    """What one KV cache group's layers wrote in a window's later step, as a digest per layer and
    request (`runners.kv_digest`): which request wrote other KV, from which layer on, without blocks."""

    layer_names: list[str]  # the layers digested, the model's own (a drafter's write later), in row order
    digests: Tensor  # int64 [len(layer_names), requests in batch order]


@dataclass
class CarriedStep(SchemaRecord):
    """A later step of a window: what the engine handed the runner and what came out (the runner
    carried its state from the step before, so there are no request states and no KV blocks)."""

    index: Count  # the engine step, the one after the window's previous step
    scheduler_output: SchedulerOutputRecord  # as the runner received it
    batch_order: list[str]
    runner_states: dict[str, RunnerState] = field(default_factory=dict)  # per request of the batch
    input_ids: Tensor | None = None  # as in a `Step`
    positions: Tensor | None = None
    graph: GraphDispatch | None = None  # None for a step that failed before its forward
    rng: dict[str, Tensor] = field(default_factory=dict)  # global generator states at the forward
    kv: KVSnapshot | None = None  # the blocks it reads that no step before it wrote or saved
    outputs: StepOutputs | None = None
    timing: StepTiming = field(default_factory=StepTiming)
    error: StepError | None = None  # if the step raised (the window's last step)
    grammar: GrammarRecord | None = None  # the structured-output mask sampling received, if any
    proposals: Tensor | None = None  # as `SpecDecodeRecord.proposals`
    kv_written: list[KVWritten] = field(default_factory=list)  # per KV cache group (empty: not kept)


@dataclass
class StepWindow(SchemaRecord):
    """The steps after a bundle's first, recorded as one window (`tracekit record --window N`):
    the first step whole, each later one as a `CarriedStep`."""

    requested: Annotated[int, Range(2, INT32_MAX)]  # the steps asked for, the first included
    steps: list[CarriedStep] = field(default_factory=list)
    held_requests: list[RequestState] = field(default_factory=list)  # outside the first step's batch
    calls: list[WindowCall] = field(default_factory=list)  # in the order the engine made them


LoRAId = Annotated[int, Range(1, INT32_MAX)]  # vLLM's lora_int_id (0 means none)
ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter's config file
KEPT_WEIGHTS_SUFFIX = ".safetensors"  # the weight files a bundle may keep (loading one executes nothing)


@dataclass
class LoRAAdapter(SchemaRecord):
    """A LoRA adapter resident in one of the engine's LoRA slots when the step ran: its identity,
    and its files when the bundle keeps them."""

    name: str | None  # vLLM's lora_name (None: loaded before the recorder was armed)
    int_id: LoRAId
    slot: Count  # its index among the engine's `max_loras` slots
    path: str | None = None  # where the recording engine loaded it from
    rank: Count | None = None  # `r` of its adapter_config.json
    alpha: float | None = None  # `lora_alpha`
    target_modules: list[str] = field(default_factory=list)
    fingerprint: str | None = None  # as the model's `weights_fingerprint`; None: unreadable files
    size_bytes: Annotated[int, Range(0, INT64_MAX)] | None = None  # of those files
    files: dict[str, Tensor] = field(default_factory=dict)  # file name -> uint8 tensor of its bytes

    def check_values(self, where: str) -> None:
        """A kept file is written back into a folder by that name: a plain name of the two kinds."""
        for name in self.files:
            plain = "/" not in name and "\\" not in name and name not in ("", ".", "..")
            if not (plain and (name == ADAPTER_CONFIG or name.endswith(KEPT_WEIGHTS_SUFFIX))):
                raise BundleError(f"bundle content: {where}.files holds {name!r}: only {ADAPTER_CONFIG} and "
                                  f"*{KEPT_WEIGHTS_SUFFIX} files are kept and written back")


@dataclass
class Step(SchemaRecord):
    index: Count  # the engine step (count of non-empty forwards since arming, from 0)
    trigger: str  # what fired: "steps 3", "when num_reqs>=2", "exception", "nonfinite"
    scheduler_output: SchedulerOutputRecord
    batch_order: list[str]
    requests: list[RequestState]
    input_ids: Tensor | None  # as fed to the model (padded); None: failed before they were prepared
    positions: Tensor | None
    kv: KVSnapshot
    graph: GraphDispatch
    rng: dict[str, Tensor] = field(default_factory=dict)  # "cpu": global generator state tensor
    outputs: StepOutputs | None = None  # None when the forward raised
    timing: StepTiming = field(default_factory=StepTiming)
    error: StepError | None = None  # if the step raised
    spec_decode: SpecDecodeRecord | None = None  # the engine decodes speculatively
    grammar: GrammarRecord | None = None  # the structured-output mask sampling received, if any
    lora_adapters: list[LoRAAdapter] = field(default_factory=list)  # every one in the engine's slots
    features: dict[str, list[str]] | None = None  # which requests used what (`records.step_features`)
    window: StepWindow | None = None  # the steps recorded after this one; None: a single step

    def check_values(self, where: str) -> None:
        """A window's steps follow this one and each other, and each of its calls is a known call
        of one of its steps."""
        indices = self.window_indices
        for number, (before, after) in enumerate(zip(indices, indices[1:])):
            if after != before + 1:
                raise BundleError(f"bundle content: {where}.window.steps[{number}].index {after} does not follow "
                                  f"step {before}: a window's steps are consecutive")
        for number, call in enumerate(self.runner_calls):
            if call["call"] not in RUNNER_CALLS:
                raise BundleError(f"bundle content: {where}.window.calls[{number}].call {call['call']!r} is none of "
                                  f"{', '.join(RUNNER_CALLS)}")
            if not indices[0] <= call["step"] <= indices[-1]:
                raise BundleError(f"bundle content: {where}.window.calls[{number}] names step {call['step']}, "
                                  f"not one of the window's steps {indices[0]}..{indices[-1]}")

    @property
    def window_indices(self) -> list[int]:
        """The engine step indices of this step and the steps of its window, in order."""
        return [self.index, *(carried.index for carried in self.later)]

    @property
    def later(self) -> list[CarriedStep]:
        """The steps recorded after this one (`record --window N`), in order; none for a single step."""
        return self.window.steps if self.window else []

    @property
    def held_requests(self) -> list[RequestState]:
        """The requests the runner held outside this step's batch (kept where later steps follow)."""
        return self.window.held_requests if self.window else []

    @property
    def window_extras(self) -> dict[str, Any]:
        """Fields of the steps after this one that a newer tracekit added."""
        return self.window.extras if self.window else {}

    def with_later(self, later: list[CarriedStep], held: list[RequestState], calls: list[WindowCall] | None = None,
                   requested: int | None = None) -> "Step":
        """This step followed by `later` (the runner holding `held` outside its batch; `calls`: the
        runner calls of its steps, by default those recorded; `requested`: the steps asked for,
        by default those recorded): a single step when `later` is empty."""
        if not later:
            return dataclasses.replace(self, window=None)
        recorded = self.window or StepWindow(requested=len(later) + 1)
        return dataclasses.replace(self, window=StepWindow(
            requested=recorded.requested if requested is None else requested, steps=later, held_requests=held,
            calls=recorded.calls if calls is None else calls))

    @property
    def steps_requested(self) -> int:
        """The steps the recording asked for from this one on (`record --window N`), this one included."""
        return self.window.requested if self.window else 1

    @property
    def runner_calls(self) -> list[WindowCall]:
        """The runner calls of this step and its window's in the order the engine made them (none
        recorded for a single step)."""
        return self.window.calls if self.window else []

    def request(self, req_id: str) -> RequestState:
        """The recorded state of request `req_id` (a `BundleError` when the step has none)."""
        for request in self.requests:
            if request.req_id == req_id:
                return request
        raise BundleError(f"bundle content: step {self.index} has no request state for {req_id!r}")

    @property
    def num_real_rows(self) -> int:
        """The token rows the scheduler scheduled; rows past them (up to the padded size a graph
        ran at) are padding."""
        return self.graph.num_tokens or sum(request.num_scheduled_tokens for request in self.requests)

    def request_rows(self) -> dict[str, range]:
        """Each request's run of the step's token rows (batch order)."""
        requests = [self.request(req_id) for req_id in self.batch_order]
        return dict(zip(self.batch_order, token_runs(requests)))

    def drafts_in(self, input_ids: list[int]) -> dict[str, list[int]]:
        """The draft tokens each drafted request's rows of `input_ids` hold."""
        return {
            req_id: [int(input_ids[row]) for row in draft_rows(run, len(self.request(req_id).draft_token_ids))]
            for req_id, run in self.request_rows().items() if self.request(req_id).draft_token_ids
        }

    def accepted_drafts(self, sampled: list[list[int]]) -> dict[str, int]:
        """How many drafts the rejection sampler accepted per drafted request: its row of
        `sampled` (one a request, batch order) is its accepted drafts and one token more."""
        return {req_id: max(len(ids) - 1, 0) for req_id, ids in zip(self.batch_order, sampled)
                if self.request(req_id).draft_token_ids}

    def drafter_rows(self, call: int) -> list[int]:
        """The rows of the drafter's `call`-th model call that hold the step's tokens (which, and
        why the others are padding or rejected drafts' slots: docs/FORMAT.md, "DrafterPass")."""
        if call > 0:
            return list(range(len(self.batch_order)))
        sampled = self.outputs.sampled_token_ids if self.outputs is not None else None
        padded = self.spec_decode is None or self.spec_decode.padded_drafter_batch
        requests = [self.request(req_id) for req_id in self.batch_order]
        rows: list[int] = []
        for index, (request, run) in enumerate(zip(requests, token_runs(requests))):
            used = len(run)
            if request.draft_token_ids and sampled is not None and index < len(sampled):
                used = min(max(len(sampled[index]), 1), len(run))
            start = run.start if padded else len(rows)
            rows.extend(range(start, start + used))
        return rows
    def input_ids_disagreement(self) -> str | None:
        """Where the request states say another token than the recorded forward read (why no replay
        can then be faithful: docs/GUIDE.md, "Replaying"); a placeholder (an id below 0) or a draft
        token is the runner's to fill, not compared. Needs the input ids loaded; None where they agree
        or there are none."""
        if not hasattr(self.input_ids, "tolist") or len(self.input_ids.shape) != 1:
            return None
        read = self.input_ids.tolist()
        for req_id, run in self.request_rows().items():
            if run.stop > len(read):
                return f"its input ids hold {len(read)} rows, fewer than the requests' scheduled tokens"
            request = self.request(req_id)
            known = [*request.prompt_token_ids, *request.output_token_ids]
            for position, row in zip(range(request.num_computed_tokens, len(known)), run):
                if known[position] >= 0 and known[position] != read[row]:
                    return (f"request {req_id!r} holds token {known[position]} at position {position}, where the "
                            f"recorded forward read {read[row]} (row {row})")
        return None


@dataclass
class ParallelRank(SchemaRecord):
    """Which rank of a multi-rank engine wrote this bundle, and what ties it to the other ranks'
    bundles of the same step (a single-rank engine's bundle has the defaults)."""

    world_size: Ranks = 1
    rank: Rank = 0  # pp_rank * tensor_parallel_size + tp_rank
    tensor_parallel_size: Ranks = 1
    pipeline_parallel_size: Ranks = 1
    tp_rank: Rank = 0
    pp_rank: Rank = 0
    set_id: str | None = None  # shared by every rank's bundles of one recording session
    parts: list[str] = field(default_factory=list)  # every rank's bundle, relative to this one's folder

    @property
    def multi_rank(self) -> bool:
        return self.world_size != 1

    def check_values(self, where: str) -> None:
        if self.tensor_parallel_size * self.pipeline_parallel_size != self.world_size:
            raise BundleError(
                f"bundle content: {where}: TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} "
                f"is not the world size {self.world_size}"
            )
        if self.rank >= self.world_size:
            raise BundleError(f"bundle content: {where}.rank {self.rank} is not below the world size {self.world_size}")
        if len(self.parts) > self.world_size:
            raise BundleError(f"bundle content: {where}.parts should be at most one path per rank")


@dataclass
class BundleContent(SchemaRecord):
    """The whole metadata map of a bundle."""

    environment: Environment
    engine: EngineConfig
    steps: list[Step]
    schema_version: Annotated[int, Range(1, INT64_MAX)] = SCHEMA_VERSION
    created_at: str = ""  # ISO 8601, UTC
    parallel: ParallelRank = field(default_factory=ParallelRank)
    derivations: list[dict[str, Any]] = field(default_factory=list)  # {"kind": "shrink" | "redact", ...}

    @classmethod
    def from_plain(cls, data: Any, where: str = "") -> "BundleContent":
        return super().from_plain(data, where or "bundle")

    def check_values(self, where: str) -> None:
        """Every block id a step names is a block of the recorded KV cache (a replay restores
        and reads those blocks at those ids)."""
        blocks = self.engine.num_kv_blocks
        for number, step in enumerate(self.steps):
            named = [(f"requests[{i}].block_ids", ids) for i, request in enumerate(step.requests) for ids in request.block_ids]
            named += [(f"window.held_requests[{i}].block_ids", ids)
                      for i, request in enumerate(step.held_requests) for ids in request.block_ids]
            named += [(f"kv.groups[{i}].{name}", getattr(group, name)) for i, group in enumerate(step.kv.groups)
                      for name in ("read_block_ids", "written_block_ids", "saved_block_ids")]
            for place, ids in named:
                if ids and max(ids) >= blocks:
                    raise BundleError(f"bundle content: {where}.steps[{number}].{place} holds block {max(ids)}, "
                                      f"beyond the {blocks} KV blocks of bundle.engine.num_kv_blocks")

    @classmethod
    def claimed_by(cls, metadata: Any) -> bool:
        """Whether a bundle's metadata is meant as recorded content (a map holding any of its
        fields): a problem in it is then a bad bundle, not a bundle of other data."""
        return type(metadata) is dict and any(name in metadata for name in record_fields(cls))
