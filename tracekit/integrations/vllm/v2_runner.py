"""The adapter for vLLM's Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py` and its CPU
subclass `vllm/v1/worker/cpu/model_runner.py`), and every V2 attribute tracekit touches.

V2 keeps no per-request objects: each request owns a slot (`req_states.req_id_to_index`, not
stable between runs) in persistent arrays: `all_token_ids` (prompt, then outputs, up to the
device-only `total_len`), `prompt_len`, `prefill_len` (tokens given when the request was added,
larger than the prompt on resume), the sampler's `seeds` (an explicit seed, or one drawn from
NumPy's global RNG when unseeded: sampling depends only on seed, position and token id) and the
block tables. Its `SamplingParams` are not kept, so the adapter remembers them from
`scheduled_new_reqs`. The step's pre-forward point on every path (eager, piecewise, FULL graph)
is `step_timing.record_batch`; logits come from `model.compute_logits` inside `sample_tokens`
(cloned at once: a grammar bitmask is applied in place after), which returns an async output.
"""

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch

from tracekit.format.schema import GraphDispatch, RequestState, Step, is_prefill
from tracekit.integrations.vllm import replay_batch, runner_state
from tracekit.integrations.vllm.method_patch import shadowed
from tracekit.integrations.vllm.runner_adapter import (
    ModelCall,
    SampledStep,
    StepObserver,
    reporting_failures,
    sampled_token_ids,
    when_output_ready,
)
from tracekit.integrations.vllm.serialize import to_plain
from tracekit.record.triggers import BatchFacts


def matches(runner: Any) -> bool:
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except ImportError:
        return False
    return isinstance(runner, GPUModelRunner)


class Adapter:
    kind = "v2"

    def __init__(self, runner: Any):
        self.runner = runner
        self._new_requests: dict[str, Any] = {}  # req_id -> NewRequestData (its SamplingParams)
        self._input_batch: Any = None  # the step's InputBatch, seen at record_batch
        self._dispatched: Any = None  # the step's BatchExecutionDescriptor
        self._logits_wanted = False
        self._replay_logits: torch.Tensor | None = None

    # -- recording -------------------------------------------------------------------------

    def observe(self, observer: StepObserver) -> AbstractContextManager:
        runner, adapter = self.runner, self

        def execute_model(original: Any) -> Any:
            def wrapper(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                if kwargs.get("dummy_run") or scheduler_output.total_num_scheduled_tokens == 0:
                    return original(scheduler_output, *args, **kwargs)
                adapter._input_batch = adapter._dispatched = None
                observer.step_started(scheduler_output)
                result = reporting_failures(observer, original)(scheduler_output, *args, **kwargs)
                if observer.tracking:
                    state = runner.execute_model_state
                    observer.after_forward(state.hidden_states if state is not None else None)
                    if result is not None:  # a non-last pipeline rank: no sampling here
                        observer.output_receiver()(None)
                return result

            return wrapper

        def record_batch(original: Any) -> Any:
            def wrapper(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
                adapter._input_batch = input_batch
                num_tokens = input_batch.num_tokens_after_padding
                observer.before_forward(input_batch.input_ids[:num_tokens], input_batch.positions[:num_tokens])
                return original(input_batch, *args, **kwargs)

            return wrapper

        def dispatch(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                adapter._dispatched = original(*args, **kwargs)
                return adapter._dispatched

            return wrapper

        def sample_tokens(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                adapter._logits_wanted = observer.tracking
                try:
                    output = reporting_failures(observer, original)(*args, **kwargs)
                finally:
                    adapter._logits_wanted = False
                return when_output_ready(output, observer.output_receiver()) if observer.tracking else output

            return wrapper

        def compute_logits(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                logits = original(*args, **kwargs)
                if adapter._logits_wanted:
                    adapter._logits_wanted = False
                    observer.logits_computed(logits)
                    observer.phase_entered("sampling")
                return logits

            return wrapper

        def postprocess_sampled(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                observer.phase_entered("bookkeeping")
                return original(*args, **kwargs)

            return wrapper

        stack = ExitStack()
        stack.enter_context(
            shadowed(runner, {
                "execute_model": execute_model,
                "sample_tokens": sample_tokens,
                "postprocess_sampled": postprocess_sampled,
            })
        )
        stack.enter_context(shadowed(runner.step_timing, {"record_batch": record_batch}))
        stack.enter_context(shadowed(runner.model, {"compute_logits": compute_logits}))
        if runner.cudagraph_manager is not None:
            stack.enter_context(shadowed(runner.cudagraph_manager, {"dispatch": dispatch}))
        return stack

    def scheduler_output_seen(self, scheduler_output: Any) -> None:
        """Remember what V2 forgets: each new (or resumed) request's sampling params."""
        for req_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self._new_requests.pop(req_id, None)
        for request in scheduler_output.scheduled_new_reqs:
            self._new_requests[request.req_id] = request

    def _rows(self) -> list[tuple[int, str, int]]:
        """(batch row, req_id, slot) of the step's batch, in batch order."""
        batch = self._input_batch
        return [(row, req_id, int(batch.idx_mapping_np[row])) for row, req_id in enumerate(batch.req_ids)]

    def batch_facts(self, scheduler_output: Any) -> BatchFacts:
        """From host arrays only (no device read): a row below its `prefill_len` still prefills,
        one past it decodes, and so it has sampled `computed - prompt + 1` outputs."""
        batch, states = self._input_batch, self.runner.req_states
        num_prefills = 0
        for row, _, slot in self._rows():
            computed, prompt = int(batch.num_computed_tokens_np[row]), int(states.prompt_len.np[slot])
            prefill_len = int(batch.prefill_len_np[row])
            outputs = computed - prompt + 1 if computed >= prefill_len else prefill_len - prompt
            num_prefills += is_prefill(computed, prompt, outputs)
        return BatchFacts(batch.num_reqs, int(scheduler_output.total_num_scheduled_tokens), num_prefills, frozenset(batch.req_ids))

    def batch_order(self) -> list[str]:
        return list(self._input_batch.req_ids)

    def request_states(self, scheduler_output: Any) -> list[RequestState]:
        runner, batch = self.runner, self._input_batch
        states, tables = runner.req_states, runner.block_tables
        sampling = runner.sampler.sampling_states if runner.sampler is not None else None
        result = []
        for row, req_id, slot in self._rows():
            prompt_len, total_len = int(states.prompt_len.np[slot]), int(states.total_len.gpu[slot])
            tokens = states.all_token_ids.gpu[slot, :total_len].tolist()
            new_request = self._new_requests.get(req_id)
            params = new_request.sampling_params if new_request is not None else None
            result.append(
                RequestState(
                    req_id=req_id,
                    prompt_token_ids=tokens[:prompt_len],
                    output_token_ids=tokens[prompt_len:],
                    block_ids=[
                        table.gpu[slot, : int(tables.num_blocks.np[group, slot])].tolist()
                        for group, table in enumerate(tables.block_tables)
                    ],
                    num_computed_tokens=int(batch.num_computed_tokens_np[row]),
                    num_scheduled_tokens=int(scheduler_output.num_scheduled_tokens[req_id]),
                    sampling_params=to_plain(params, f"{req_id}.sampling_params") if params is not None else None,
                    seed=int(sampling.seeds.np[slot]) if sampling is not None else None,
                    prefill_len=int(states.prefill_len.np[slot]),
                )
            )
        return result

    def graph_dispatch(self, num_tokens: int) -> GraphDispatch:
        descriptor = self._dispatched
        return runner_state.graph_dispatch(
            self.runner,
            num_tokens,
            descriptor.cg_mode.name if descriptor is not None else "NONE",
            int(self._input_batch.num_tokens_after_padding),
            descriptor,
        )

    # -- replay ----------------------------------------------------------------------------

    def scheduler_output_for(self, step: Step) -> Any:
        return replay_batch.new_requests_output(step)

    def replaying(self, step: Step, on_model_call: ModelCall) -> AbstractContextManager:
        """Put back each request's seed as the sampler adds it, and its `prefill_len` before
        the runner decides which rows prefill (so decodes run as decodes, with their last
        sampled token as input); hand every model call to `on_model_call`."""
        runner, adapter = self.runner, self
        recorded = {request.req_id: request for request in step.requests}
        states = runner.req_states

        def sampler_add_request(original: Any) -> Any:
            def wrapper(slot: int, sampling_params: Any) -> Any:
                result = original(slot, sampling_params)
                request = recorded.get(states.index_to_req_id.get(slot))
                if request is not None and request.seed is not None:
                    runner.sampler.sampling_states.seeds.np[slot] = request.seed
                return result

            return wrapper

        def update_requests(original: Any) -> Any:
            def wrapper(scheduler_output: Any) -> Any:
                for req_id, request in recorded.items():
                    slot = states.req_id_to_index.get(req_id)
                    if slot is None or request.prefill_len is None:
                        continue
                    states.prefill_len.np[slot] = request.prefill_len
                    if request.output_token_ids and request.num_computed_tokens >= request.prefill_len:
                        states.last_sampled_tokens[slot, 0] = request.output_token_ids[-1]
                states.prefill_len.copy_to_uva()
                return original(scheduler_output)

            return wrapper

        def model_call(original: Any) -> Any:
            return lambda *args, **kwargs: on_model_call(original, args, kwargs)

        def compute_logits(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                logits = original(*args, **kwargs)
                if adapter._logits_wanted:
                    adapter._logits_wanted = False
                    adapter._replay_logits = logits.detach().to("cpu", copy=True)
                return logits

            return wrapper

        stack = ExitStack()
        stack.enter_context(shadowed(runner, {"update_requests": update_requests}))
        stack.enter_context(shadowed(runner.model, {"forward": model_call, "compute_logits": compute_logits}))
        if runner.sampler is not None:
            stack.enter_context(shadowed(runner.sampler, {"add_request": sampler_add_request}))
        if runner.cudagraph_manager is not None:  # FULL graphs: no model call (untested here)
            stack.enter_context(shadowed(runner.cudagraph_manager, {"run_fullgraph": model_call}))
        return stack

    def execute_and_sample(self, scheduler_output: Any) -> SampledStep:
        runner = self.runner
        try:
            if runner.execute_model(scheduler_output) is not None:
                raise RuntimeError("the runner produced no forward for the recorded step")
            batch_order = list(runner.execute_model_state.input_batch.req_ids)
            self._replay_logits, self._logits_wanted = None, True
            sampled = sampled_token_ids(runner.sample_tokens(None))
        finally:
            self._logits_wanted = False
            runner.execute_model_state = None
        return SampledStep(batch_order, self._replay_logits, sampled)
