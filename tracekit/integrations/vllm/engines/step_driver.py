"""Putting one recorded step back into a rebuilt runner's real `execute_model`/`sample_tokens`
(`sequence_driver` runs the steps).

The scheduler never saw the recorded requests, so the driver hands the runner a
`SchedulerOutput` in which each of them is new, with its recorded prompt, computed tokens and
block ids. While the runner adds them, its adapter puts back what that runner kind keeps per
request (output tokens, generator states or seeds; so penalties, min_tokens, bad words and
logprobs see what the engine saw). The runner then prepares the step and dispatches it as it
would any step (eager, compiled, or a CUDA graph of the padded size); just before the model
call the recorded KV blocks are written at their block ids, the recorded padding rows of the
inputs are put back and the global RNG state is restored (`ForwardHandle`, which the caller can
run again, for timing and graph capture). A bundle that saved no KV blocks but asks for them to
be recomputed (`--kv recompute`) first has its requests' recorded tokens prefilled into their
block ids.
"""

import dataclasses
import time
from typing import Any, Callable

import torch

from tracekit.errors import CannotRunHere
from tracekit.format.schema import KVMode, Step
from tracekit.graphs.modes import ReplayMode
from tracekit.integrations.seam import ObservedStep, OutputReceiver, StepObserver
from tracekit.integrations.vllm.records import grammar, spec_decode
from tracekit.integrations.vllm.runners import kv_digest, lora_adapters, runner_state
from tracekit.integrations.vllm.runners.runner_state import hidden_states_of


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.detach().to("cpu", copy=True) if tensor is not None else None


# The forward-context attributes a `ForwardHandle` form sets for one call: whether the compiled
# code runs, which of vLLM's graph wrappers replays (V1 replays FULL graphs there) and the graph
# key they look up. Every other attribute is put back as the runner built it before each call.
FORM_ATTRIBUTES = ("skip_compiled", "cudagraph_runtime_mode", "batch_descriptor")


class ForwardHandle:
    """The step's model call, repeatable: `run()` restores the recorded state, then forwards, in
    the form the engine dispatched (`compiled`) or in another that vLLM's dispatch offers for the
    same inputs (`eager`, `compiled-no-graph`, `vllm-piecewise`: docs/GUIDE.md, "Dispatch and
    modes"). A FULL graph replayed as a whole (V2's `run_fullgraph`) has no model call to run
    otherwise."""

    def __init__(self, restore: Callable[[], None], call: Callable[[], Any], context: Any,
                 written_views: Callable[[], list[torch.Tensor]], device: torch.device,
                 piecewise_key: Any = None, num_tokens_padded: int | None = None):
        self.restore = restore  # puts the recorded state back
        self._call = call
        self._context = context  # the forward context of the call (None: a FULL graph replay)
        self.state_views = written_views  # views of every KV block the forward writes (for in-graph restores)
        self._piecewise_key = piecewise_key  # vLLM's PIECEWISE graph key of the padded size, if captured
        self._num_tokens_padded = num_tokens_padded
        self.device = device

    def unavailable_reason(self, form: str) -> str | None:
        """Why the call cannot run in `form` (a `ReplayMode` of the replay engine), or None."""
        if form == ReplayMode.COMPILED.value:
            return None
        if self._context is None:
            return (
                "the step ran as a FULL CUDA graph replayed whole (no model call), which has no other form "
                "to run here; replay it on an engine without FULL graphs "
                "(--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}') to run it otherwise"
            )
        if form == ReplayMode.VLLM_PIECEWISE.value and self._piecewise_key is None:
            return f"the engine captured no PIECEWISE CUDA graph of the step's padded size ({self._num_tokens_padded} tokens)"
        return None

    def forward(self, form: str = ReplayMode.COMPILED.value) -> Any:
        """The model call alone (no restore), in `form`: as the engine dispatched it by default."""
        reason = self.unavailable_reason(form)
        if reason is not None:
            raise CannotRunHere(reason)
        if form == ReplayMode.COMPILED.value:
            return self._call()
        from vllm.config import CUDAGraphMode

        context = self._context
        saved = tuple(getattr(context, name) for name in FORM_ATTRIBUTES)
        forms = {
            ReplayMode.EAGER.value: (True, CUDAGraphMode.NONE, context.batch_descriptor),
            ReplayMode.COMPILED_NO_GRAPH.value: (False, CUDAGraphMode.NONE, context.batch_descriptor),
            ReplayMode.VLLM_PIECEWISE.value: (False, CUDAGraphMode.PIECEWISE, self._piecewise_key),
        }
        if form not in forms:
            raise CannotRunHere(f"the replay engine runs no {form!r} form of a step")
        for name, value in zip(FORM_ATTRIBUTES, forms[form]):
            setattr(context, name, value)
        try:
            return self._call()
        finally:
            for name, value in zip(FORM_ATTRIBUTES, saved):
                setattr(context, name, value)

    def run(self, form: str = ReplayMode.COMPILED.value) -> Any:
        self.restore()
        return self.forward(form)


class ReplayObserver(StepObserver):
    """What the adapter's shadows report during a replayed step, kept for the checks of the step
    in progress (`current`: its observations). The reports it takes no note of (the step's start,
    its forward, the grammar the driver handed over, phases, idle steps, failures the driver
    reports itself) keep the protocol's bodies, which do nothing."""

    tracking = True

    def __init__(self, current: Callable[[], ObservedStep]):
        self.current = current

    @property
    def observed(self) -> ObservedStep:
        return self.current()

    def logits_computed(self, logits: Any) -> None:
        if self.observed.logits is None and logits is not None:
            self.observed.logits = _to_host(logits)

    def grammar_applied(self, logits: Any) -> None:
        if self.observed.grammar_bitmask is None:
            self.observed.grammar_bitmask = _to_host(grammar.applied_mask(logits))

    def drafter_called(self, inputs: dict[str, Any], output: Any) -> None:
        self.observed.drafter_calls.append(spec_decode.drafter_pass(inputs, output, _to_host))

    def drafts_proposed(self, read: Callable[[], Any]) -> None:
        self.observed.proposals = _to_host(read())

    def output_receiver(self) -> OutputReceiver:
        observed = self.observed  # the step just sampled (its output may be read after the next started)

        def receive(sampled: list[list[int]] | None) -> None:
            if sampled is not None:
                observed.sampled_token_ids = [list(map(int, ids)) for ids in sampled]

        # a failed read raises on into the driver, which reports the step's failure itself
        return OutputReceiver(receive, failed=lambda error: None)


def tokens_to_recompute(request: Any, count: int | None = None) -> list[int]:
    """The token ids a `--kv recompute` replay prefills for `request`: all it had before the step
    (or its first `count`)."""
    return [*request.prompt_token_ids, *request.output_token_ids][: request.num_computed_tokens if count is None else count]


def unknown_tokens_to_recompute(step: Step) -> int:
    """How many token ids a recompute replay of `step` needs that its bundle does not hold (ids
    below 0): those it prefills, and the step's own where the bundle has no input ids (a step
    kept from host memory). A V1 recording under async scheduling holds only the sampled ids its
    step reads and those the recorder read from the steps it saw (`tracekit.record.sampled_ids`)."""
    unknown = 0
    for request in step.requests:
        needed = request.num_computed_tokens + (request.num_scheduled_tokens if step.input_ids is None else 0)
        unknown += sum(1 for token in tokens_to_recompute(request, needed) if token < 0)
    return unknown


def recompute_kv(adapter: Any, step: Step, loras: dict[str, Any]) -> None:
    """Rebuild the KV blocks `step` reads by prefilling, through the runner, each request's
    recorded tokens before the step (`[0, num_computed_tokens)`) into its recorded block ids: a
    `--kv recompute` bundle saved none (its device context was lost when it was recorded). Each
    request prefills alone, in pieces of at most the engine's token budget, greedily (its own
    sampling, seeds included, is left for the step), and is finished after each piece."""
    from vllm import SamplingParams

    greedy = adapter.sampling_record(SamplingParams(temperature=0.0, max_tokens=1), "recompute.sampling_params")
    budget = int(adapter.runner.scheduler_config.max_num_batched_tokens)  # the most tokens a step may schedule
    for request in step.requests:
        tokens = tokens_to_recompute(request)
        for start in range(0, len(tokens), budget):
            piece = dataclasses.replace(
                request, prompt_token_ids=tokens, output_token_ids=[], num_computed_tokens=start,
                num_scheduled_tokens=min(budget, len(tokens) - start), sampling_params=greedy, runner_state={},
            )
            prefill = dataclasses.replace(step, requests=[piece], batch_order=[request.req_id])
            try:
                adapter.execute_and_sample(adapter.scheduler_output_for(prefill, loras=loras))
            finally:
                adapter.finish([request.req_id])


class StepDriver:
    """Runs one recorded step through a runner (`lora_paths`: where each of its LoRA adapters is
    here, by int id; `lora_adapters.locate`)."""

    def __init__(self, adapter: Any, step: Step, lora_paths: dict[int, str] | None = None):
        self.adapter = adapter
        self.step = step
        spec_decode.fill_drafts_from_inputs(step)
        self.lora_paths = dict(lora_paths or {})
        self.loras = lora_adapters.lora_requests(step.lora_adapters, self.lora_paths)
        self.groups = adapter.kv_groups()
        if len(self.groups) != len(step.kv.groups):
            raise CannotRunHere(
                f"the rebuilt engine has {len(self.groups)} KV cache group(s); the bundle has "
                f"{len(step.kv.groups)}: replay on the recorded model, without engine arguments that change it"
            )
        for live, recorded in zip(self.groups, step.kv.groups):
            if live.layer_names != recorded.layer_names or live.layout.shape != recorded.layout.shape:
                raise CannotRunHere(
                    f"KV cache layout differs: bundle {recorded.layout.shape} for "
                    f"{recorded.layer_names[:1]}..., engine {live.layout.shape} for {live.layer_names[:1]}...: "
                    "replay on the recorded model, without engine arguments that change its KV cache"
                )

    def prepare_runner(self) -> None:
        """The runner's LoRA slots as the step found them, for a `--kv recompute` bundle its KV
        blocks rebuilt by prefilling (under those slots: the prefill runs the requests' adapters,
        and may move them, so they are put back after), and the rest of the runner as one that
        rebuilt no step before holds it (`start_afresh`: nothing an earlier replay, or the
        prefills, left behind reaches the step)."""
        adapter, step = self.adapter, self.step
        if step.kv.mode == KVMode.RECOMPUTE.value:
            lora_adapters.restore_slots(adapter.runner, step.lora_adapters, self.lora_paths)
            recompute_kv(adapter, step, self.loras)
        lora_adapters.restore_slots(adapter.runner, step.lora_adapters, self.lora_paths)
        adapter.start_afresh()

    # -- the recorded state, put back ----------------------------------------------------------

    def _restore_kv(self) -> None:
        """The KV blocks the bundle saved for the step, written back at their block ids."""
        for live, recorded in zip(self.groups, self.step.kv.groups):
            if not recorded.saved_block_ids:
                continue
            index = torch.tensor(recorded.saved_block_ids, dtype=torch.long, device=live.caches[0].device)
            for name, cache in zip(live.layer_names, live.caches):
                saved = recorded.before[name].to(cache.device)
                cache.index_copy_(live.layout.block_dim, index, saved)

    def _padding_restorer(self, live_ids: torch.Tensor | None, live_positions: torch.Tensor | None) -> Callable[[], None]:
        """Writes the recorded padding rows (past the scheduled tokens, up to the padded size)
        into the live input buffers, where a graph of the padded size reads them."""
        real = self.step.num_real_rows
        pairs = [
            (live, recorded) for live, recorded in ((live_ids, self.step.input_ids), (live_positions, self.step.positions))
            if live is not None and isinstance(recorded, torch.Tensor) and recorded.dim() == 1 and live.dim() == 1
            and live.shape[0] == recorded.shape[0] > real
        ]

        def restore() -> None:
            for live, recorded in pairs:
                live[real:].copy_(recorded[real:].to(live.device, live.dtype))

        return restore

    def _written_views(self) -> list[torch.Tensor]:
        views = []
        for live, recorded in zip(self.groups, self.step.kv.groups):
            for cache in live.caches:
                views.extend(cache.select(live.layout.block_dim, block) for block in recorded.written_block_ids)
        return views

    def _kv_blocks(self, block_ids: Callable[[Any], list[int]]) -> list[dict[str, torch.Tensor]]:
        """Per KV cache group, the blocks `block_ids(recorded group)` names, copied to host as they stand."""
        return [runner_state.blocks_to_host(live, block_ids(recorded))
                for live, recorded in zip(self.groups, self.step.kv.groups)]

    def _kv_written(self, positions: torch.Tensor | None, layers: list[list[str]] | None) -> list[Any]:
        """The digest of the KV the forward wrote to `layers`, as a window's later step records it."""
        requests = [self.step.request(req_id) for req_id in self.step.batch_order]
        return kv_digest.kv_written(
            self.groups, layers, positions, [request.num_scheduled_tokens for request in requests],
            [request.block_ids for request in requests], lambda compute: _to_host(compute()))

    def model_call(self, observed: ObservedStep, on_forward: Callable | None = None, restore: bool = True,
                   keep_kv_read: bool = False, digest_kv: list[list[str]] | None = None) -> Callable:
        """What runs in place of the runner's model call: restore (the recorded KV blocks, RNG
        states and padding rows; with `restore` False, a step whose runner carried its state from
        the step before, only the padding rows and the few KV blocks such a step saved), forward
        (timed), capture; `keep_kv_read`: also copy the blocks the forward reads
        (`ObservedStep.kv_read`); `digest_kv`: per KV cache group, the layers whose writes to
        digest as a window's later step records them (`ObservedStep.kv_written`)."""
        adapter = self.adapter
        backend = adapter.device_backend

        def model_call(original: Callable, args: tuple, kwargs: dict) -> Any:
            context = runner_state.forward_context()
            saved_context = (
                {name: value for name, value in vars(context).items() if name not in FORM_ATTRIBUTES}
                if context is not None else {}
            )

            def call() -> Any:
                # Models may update the forward context in place; every call starts from the
                # context the runner built.
                for name, value in saved_context.items():
                    setattr(context, name, value)
                return original(*args, **kwargs)

            live_ids, live_positions = adapter.forward_inputs(args, kwargs)
            restore_padding = self._padding_restorer(live_ids, live_positions)

            def restore_recorded() -> None:
                self._restore_kv()
                if restore:
                    self.adapter.restore_rng_states(self.step.rng)
                restore_padding()

            padded = int(live_ids.shape[0]) if live_ids is not None else self.step.num_real_rows
            handle = ForwardHandle(restore_recorded, call, context, self._written_views, adapter.device,
                                   adapter.piecewise_graph_key(padded, context), padded)
            observed.dispatch = adapter.graph_dispatch(self.step.num_real_rows, padded)
            handle.restore()
            if keep_kv_read:  # as the forward is about to read them (a window's step rebuilt on the KV the steps before left)
                observed.kv_read = self._kv_blocks(lambda group: group.read_block_ids)
            observed.input_ids, observed.positions = _to_host(live_ids), _to_host(live_positions)
            # The KV blocks written, and any other block the forward wrote (a padding slot's), are
            # read off a rebuilt step only: a carried one recorded none to compare.
            fingerprints = [runner_state.block_fingerprints(group) for group in self.groups] if restore else []
            started = time.perf_counter()
            output = handle.forward()
            backend.synchronize()
            observed.forward_us = (time.perf_counter() - started) * 1e6
            observed.hidden_states = _to_host(hidden_states_of(output))
            if restore:
                observed.kv_after = self._kv_blocks(lambda group: group.written_block_ids)
                observed.kv_changed_elsewhere = [
                    sorted(set(runner_state.changed_blocks(group, before)) - set(recorded.written_block_ids))
                    for group, before, recorded in zip(self.groups, fingerprints, self.step.kv.groups)
                ]
            if digest_kv is not None:
                observed.kv_written = self._kv_written(live_positions, digest_kv)
            if on_forward is not None:
                on_forward(handle)
                output = handle.run()  # leave buffers and RNG exactly as after the checked run
            return output

        return model_call
