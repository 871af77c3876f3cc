"""Driving one recorded step through a rebuilt runner's real `execute_model`/`sample_tokens`.

The scheduler never saw the recorded requests, so the driver hands the runner a
`SchedulerOutput` in which each of them is new, with its recorded prompt, computed tokens and
block ids. While the runner adds them to its persistent batch, the recorded output tokens and
generator states are put back (so penalties, min_tokens, bad words and logprobs see what the
engine saw); just before the model call, the recorded KV blocks are written at their block ids
and the global RNG state is restored. Afterwards the requests are finished in the runner, which
is left able to serve.

The model call is handed to the caller as a `ForwardHandle`: it can run the exact forward
again (each run restores KV and RNG first), eagerly or compiled, for timing and graph capture.
"""

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tracekit.errors import CannotRunHere
from tracekit.format.schema import RequestState, Step
from tracekit.graphs.device import get_device_backend
from tracekit.integrations.vllm import runner_state
from tracekit.integrations.vllm.method_patch import shadowed
from tracekit.integrations.vllm.serialize import from_plain


@dataclass
class ObservedStep:
    """What the replayed step produced, in the same shapes the recorder stored."""

    batch_order: list[str] = field(default_factory=list)
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    sampled_token_ids: list[list[int]] | None = None
    kv_after: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per KV group
    forward_us: float | None = None  # wall time of the checked (first) forward


class ForwardHandle:
    """The step's model call, repeatable: `run()` restores the recorded state, then forwards."""

    def __init__(
        self,
        restore: Callable[[], None],
        call: Callable[[], Any],
        written_views: Callable[[], list[torch.Tensor]],
        device: torch.device,
    ):
        self._restore = restore
        self._call = call
        self._written_views = written_views
        self.device = device

    def restore(self) -> None:
        self._restore()

    def forward(self, eager: bool = False) -> Any:
        """The model call alone (no restore), compiled as the engine is, or eagerly."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        saved = context.skip_compiled
        context.skip_compiled = eager or saved
        try:
            return self._call()
        finally:
            context.skip_compiled = saved

    def run(self, eager: bool = False) -> Any:
        self._restore()
        return self.forward(eager)

    def state_views(self) -> list[torch.Tensor]:
        """Views of every KV block the forward writes (for in-graph restores)."""
        return self._written_views()


def _unsupported(step: Step) -> str | None:
    plain = step.scheduler_output
    if plain.get("scheduled_spec_decode_tokens"):
        return "speculative decoding steps"
    for request in plain.get("scheduled_new_reqs", []):
        if request.get("mm_features") or request.get("lora_request") or request.get("prompt_embeds") is not None:
            return "multimodal, LoRA or prompt-embeds requests"
    return None


class StepDriver:
    def __init__(self, runner: Any, step: Step):
        reason = _unsupported(step)
        if reason is not None:
            raise CannotRunHere(f"replaying {reason} is not supported yet")
        self.runner = runner
        self.step = step
        self.groups = runner_state.kv_groups(runner)
        if len(self.groups) != len(step.kv.groups):
            raise CannotRunHere(
                f"the rebuilt engine has {len(self.groups)} KV cache group(s); the bundle has "
                f"{len(step.kv.groups)}"
            )
        for live, recorded in zip(self.groups, step.kv.groups):
            if live.layer_names != recorded.layer_names or live.layout.shape != recorded.layout.shape:
                raise CannotRunHere(
                    f"KV cache layout differs: bundle {recorded.layout.shape} for "
                    f"{recorded.layer_names[:1]}..., engine {live.layout.shape} for {live.layer_names[:1]}..."
                )

    def run(self, on_forward: Callable[[ForwardHandle], None] | None = None) -> ObservedStep:
        observed = ObservedStep()
        requests = {request.req_id: request for request in self.step.requests}
        with torch.inference_mode(), ExitStack() as stack:
            stack.enter_context(
                shadowed(self.runner.input_batch, {"add_request": self._wrap_add_request(requests)})
            )
            stack.enter_context(
                shadowed(self.runner, {"_model_forward": self._wrap_model_forward(observed, on_forward)})
            )
            try:
                result = self.runner.execute_model(self._scheduler_output())
                if result is not None:
                    raise RuntimeError("the runner produced no forward for the recorded step")
                observed.batch_order = list(self.runner.input_batch.req_ids)
                logits = self.runner.execute_model_state.logits
                observed.logits = logits.detach().to("cpu", copy=True) if logits is not None else None
                output = self.runner.sample_tokens(None)
                observed.sampled_token_ids = [list(map(int, ids)) for ids in output.sampled_token_ids]
            finally:
                self.runner.execute_model_state = None
                self._release(list(requests))
        return observed

    def _scheduler_output(self) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        new_requests = []
        for req_id in self.step.batch_order:
            request = next(r for r in self.step.requests if r.req_id == req_id)
            new_requests.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    mm_features=[],
                    sampling_params=from_plain(request.sampling_params),
                    pooling_params=None,
                    block_ids=tuple(list(ids) for ids in request.block_ids),
                    num_computed_tokens=request.num_computed_tokens,
                    lora_request=None,
                )
            )
        scheduled = {r.req_id: r.num_scheduled_tokens for r in self.step.requests}
        return SchedulerOutput(
            scheduled_new_reqs=new_requests,
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
        )

    def _wrap_add_request(self, requests: dict[str, RequestState]) -> Callable:
        def wrap(original: Callable) -> Callable:
            def add_request(state: Any) -> Any:
                recorded = requests.get(state.req_id)
                if recorded is not None:
                    state.output_token_ids.extend(recorded.output_token_ids)
                    if state.generator is not None and recorded.generator_state is not None:
                        state.generator.set_state(recorded.generator_state)
                return original(state)

            return add_request

        return wrap

    def _restore_state(self) -> None:
        for live, recorded in zip(self.groups, self.step.kv.groups):
            if not recorded.saved_block_ids:
                continue
            index = torch.tensor(recorded.saved_block_ids, dtype=torch.long, device=live.caches[0].device)
            for name, cache in zip(live.layer_names, live.caches):
                saved = recorded.before[name].to(cache.device)
                cache.index_copy_(live.layout.block_dim, index, saved)
        if "cpu" in self.step.rng:
            torch.set_rng_state(self.step.rng["cpu"])
        if "cuda" in self.step.rng and self.runner.device.type == "cuda":
            torch.cuda.set_rng_state(self.step.rng["cuda"], self.runner.device)

    def _written_views(self) -> list[torch.Tensor]:
        views = []
        for live, recorded in zip(self.groups, self.step.kv.groups):
            for cache in live.caches:
                views.extend(cache.select(live.layout.block_dim, block) for block in recorded.written_block_ids)
        return views

    def _kv_after(self) -> list[dict[str, torch.Tensor]]:
        return [
            runner_state.blocks_to_host(live, recorded.written_block_ids)
            for live, recorded in zip(self.groups, self.step.kv.groups)
        ]

    def _wrap_model_forward(self, observed: ObservedStep, on_forward: Callable | None) -> Callable:
        def wrap(original: Callable) -> Callable:
            def model_forward(*args: Any, **kwargs: Any) -> Any:
                from vllm.forward_context import get_forward_context

                context = get_forward_context()
                saved_context = dict(vars(context))

                def call() -> Any:
                    # Models may update the forward context in place; every call starts from
                    # the context the runner built.
                    for name, value in saved_context.items():
                        setattr(context, name, value)
                    return original(*args, **kwargs)

                handle = ForwardHandle(self._restore_state, call, self._written_views, self.runner.device)
                input_ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
                observed.input_ids = input_ids.detach().to("cpu", copy=True) if input_ids is not None else None
                observed.positions = positions.detach().to("cpu", copy=True) if positions is not None else None
                started = time.perf_counter()
                output = handle.run()
                get_device_backend(self.runner.device).synchronize()
                observed.forward_us = (time.perf_counter() - started) * 1e6
                hidden = output[0] if isinstance(output, tuple) else output
                observed.hidden_states = hidden.detach().to("cpu", copy=True)
                observed.kv_after = self._kv_after()
                if on_forward is not None:
                    on_forward(handle)
                    output = handle.run()  # leave buffers and RNG exactly as after the checked run
                return output

            return model_forward

        return wrap

    def _release(self, req_ids: list[str]) -> None:
        from vllm.v1.core.sched.output import SchedulerOutput

        finish = SchedulerOutput.make_empty()
        finish.finished_req_ids = set(req_ids)
        self.runner.execute_model(finish)

