"""Driving one recorded step through a rebuilt runner's real `execute_model`/`sample_tokens`.

The scheduler never saw the recorded requests, so the driver hands the runner a
`SchedulerOutput` in which each of them is new, with its recorded prompt, computed tokens and
block ids. While the runner adds them, its adapter puts back what that runner kind keeps per
request (output tokens, generator states or seeds; so penalties, min_tokens, bad words and
logprobs see what the engine saw); just before the model call, the recorded KV blocks are
written at their block ids and the global RNG state is restored. Afterwards the requests are
finished in the runner, which is left able to serve.

The model call is handed to the caller as a `ForwardHandle`: it can run the exact forward
again (each run restores KV and RNG first), eagerly or compiled, for timing and graph capture.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tracekit.errors import CannotRunHere
from tracekit.format.schema import Step
from tracekit.graphs.device import get_device_backend
from tracekit.integrations.vllm import replay_batch, runner_state
from tracekit.integrations.vllm.runner_adapter import adapter_for


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
        self.adapter = adapter_for(runner)
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
        with torch.inference_mode(), self.adapter.replaying(self.step, self._model_call(observed, on_forward)):
            try:
                sampled = self.adapter.execute_and_sample(self.adapter.scheduler_output_for(self.step))
            finally:
                self.runner.execute_model(replay_batch.finishing_output(list(self.step.batch_order)))
        observed.batch_order = sampled.batch_order
        observed.logits = sampled.logits
        observed.sampled_token_ids = sampled.sampled_token_ids
        return observed

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

    def _model_call(self, observed: ObservedStep, on_forward: Callable | None) -> Callable:
        """What runs in place of the runner's model call: restore, forward (timed), capture."""

        def model_call(original: Callable, args: tuple, kwargs: dict) -> Any:
            from vllm.forward_context import get_forward_context, is_forward_context_available

            context = get_forward_context() if is_forward_context_available() else None
            # All but skip_compiled, which `ForwardHandle.forward(eager=)` sets for the call.
            saved_context = (
                {name: value for name, value in vars(context).items() if name != "skip_compiled"}
                if context is not None else {}
            )

            def call() -> Any:
                # Models may update the forward context in place; every call starts from the
                # context the runner built.
                for name, value in saved_context.items():
                    if name != "skip_compiled":  # set by ForwardHandle.forward(eager=) for this call
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

        return model_call
