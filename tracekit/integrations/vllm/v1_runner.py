"""The adapter for vLLM's V1 model runner (`vllm/v1/worker/gpu_model_runner.py` and its CPU
subclass), and every V1 attribute tracekit touches.

V1 keeps each request in `runner.requests[req_id]` (a `CachedRequestState`: prompt and output
tokens, block ids, sampling params, a `torch.Generator` for seeded requests) and the batch in the
persistent `runner.input_batch`. The model call is `runner._model_forward(...)`; `execute_model`
computes the logits and leaves them in `runner.execute_model_state`; `sample_tokens` samples
(`_sample`) and then updates the request states (`_bookkeeping_sync`).
"""

from contextlib import AbstractContextManager, ExitStack
from typing import Any

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
    return hasattr(runner, "input_batch") and hasattr(runner, "requests") and hasattr(type(runner), "_model_forward")


class Adapter:
    kind = "v1"

    def __init__(self, runner: Any):
        self.runner = runner

    # -- recording -------------------------------------------------------------------------

    def observe(self, observer: StepObserver) -> AbstractContextManager:
        runner = self.runner

        def execute_model(original: Any) -> Any:
            def wrapper(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                if scheduler_output.total_num_scheduled_tokens == 0:
                    return original(scheduler_output, *args, **kwargs)
                observer.step_started(scheduler_output)
                result = reporting_failures(observer, original)(scheduler_output, *args, **kwargs)
                if observer.tracking:
                    state = runner.execute_model_state
                    observer.logits_computed(state.logits if state is not None else None)
                    if result is not None:  # no sample_tokens follows this step
                        observer.output_receiver()(None)
                return result

            return wrapper

        def model_forward(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                observer.before_forward(kwargs.get("input_ids"), kwargs.get("positions"))
                output = original(*args, **kwargs)
                observer.after_forward(output)
                return output

            return wrapper

        def sample_tokens(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                observer.phase_entered("sampling")
                output = reporting_failures(observer, original)(*args, **kwargs)
                return when_output_ready(output, observer.output_receiver()) if observer.tracking else output

            return wrapper

        def bookkeeping(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                observer.phase_entered("bookkeeping")
                return original(*args, **kwargs)

            return wrapper

        return shadowed(
            runner,
            {
                "execute_model": execute_model,
                "_model_forward": model_forward,
                "sample_tokens": sample_tokens,
                "_bookkeeping_sync": bookkeeping,
            },
        )

    def scheduler_output_seen(self, scheduler_output: Any) -> None:
        """V1 keeps every request's state itself: nothing to remember."""

    def batch_facts(self, scheduler_output: Any) -> BatchFacts:
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        prompts = batch.num_prompt_tokens[:num_reqs]
        known = batch.num_tokens_no_spec[:num_reqs]
        num_prefills = sum(
            is_prefill(int(c), int(p), int(k) - int(p)) for c, p, k in zip(computed, prompts, known)
        )
        return BatchFacts(num_reqs, int(scheduler_output.total_num_scheduled_tokens), num_prefills, frozenset(batch.req_ids))

    def batch_order(self) -> list[str]:
        return list(self.runner.input_batch.req_ids)

    def request_states(self, scheduler_output: Any) -> list[RequestState]:
        """Per-request state in batch order, prompt and output tokens kept apart."""
        states = []
        batch = self.runner.input_batch
        for req_id in batch.req_ids:
            state = self.runner.requests[req_id]
            index = batch.req_id_to_index[req_id]
            generator = state.generator
            states.append(
                RequestState(
                    req_id=req_id,
                    prompt_token_ids=list(state.prompt_token_ids or []),
                    output_token_ids=list(state.output_token_ids),
                    block_ids=[list(ids) for ids in state.block_ids],
                    num_computed_tokens=int(batch.num_computed_tokens_cpu[index]),
                    num_scheduled_tokens=int(scheduler_output.num_scheduled_tokens[req_id]),
                    sampling_params=to_plain(state.sampling_params, f"{req_id}.sampling_params"),
                    generator_state=generator.get_state() if generator is not None else None,
                )
            )
        return states

    def graph_dispatch(self, num_tokens: int) -> GraphDispatch:
        """Read from the forward context the runner set for this model call."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        descriptor = context.batch_descriptor
        return runner_state.graph_dispatch(
            self.runner,
            num_tokens,
            context.cudagraph_runtime_mode.name,
            descriptor.num_tokens if descriptor is not None else num_tokens,
            descriptor,
        )

    # -- replay ----------------------------------------------------------------------------

    def scheduler_output_for(self, step: Step) -> Any:
        return replay_batch.new_requests_output(step)

    def replaying(self, step: Step, on_model_call: ModelCall) -> AbstractContextManager:
        """While the runner adds the step's requests, put back their recorded output tokens
        and generator states; hand every model call to `on_model_call`."""
        recorded = {request.req_id: request for request in step.requests}

        def add_request(original: Any) -> Any:
            def wrapper(state: Any) -> Any:
                request = recorded.get(state.req_id)
                if request is not None:
                    state.output_token_ids.extend(request.output_token_ids)
                    if state.generator is not None and request.generator_state is not None:
                        state.generator.set_state(request.generator_state)
                return original(state)

            return wrapper

        def model_forward(original: Any) -> Any:
            return lambda *args, **kwargs: on_model_call(original, args, kwargs)

        stack = ExitStack()
        stack.enter_context(shadowed(self.runner.input_batch, {"add_request": add_request}))
        stack.enter_context(shadowed(self.runner, {"_model_forward": model_forward}))
        return stack

    def execute_and_sample(self, scheduler_output: Any) -> SampledStep:
        runner = self.runner
        try:
            if runner.execute_model(scheduler_output) is not None:
                raise RuntimeError("the runner produced no forward for the recorded step")
            batch_order = list(runner.input_batch.req_ids)
            logits = runner.execute_model_state.logits
            logits = logits.detach().to("cpu", copy=True) if logits is not None else None
            sampled = sampled_token_ids(runner.sample_tokens(None))
        finally:
            runner.execute_model_state = None
        return SampledStep(batch_order, logits, sampled)
