"""`check_invariance(bundle)`: does each request of a recorded step come out the same in other
batches? An engine that is not batch invariant gives a request other numbers beside other
requests, which no replay of the recorded batch shows. The variants (built by `batch_variants`)
and what is compared: docs/GUIDE.md#batch-invariance.
"""

import itertools
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tracekit.errors import EXIT_NOT_REPRODUCED, EXIT_OK, CannotRunHere, UsageError
from tracekit.format.schema import RequestState, Step, token_runs
from tracekit.integrations.seam import ObservedStep
from tracekit.integrations.vllm.records.spec_decode import fill_drafts_from_inputs
from tracekit.integrations.vllm.records.step_records import prefix_cache_hits
from tracekit.numerics import compare_tensors
from tracekit.replay.checks import GREEDY_TEMPERATURE, check_step, first_divergence
from tracekit.share import batch_variants

VARIANT_KINDS = ("repeat", "alone", "order", "fillers", "recomputed")
# Most filler variants per step: the lowest thresholds the engine can reach.
MAX_FILLER_VARIANTS = 4
# Kernels that tile the token dimension in blocks of this many tokens change tiling at each
# multiple (vLLM's RMSNorm block size changes at 256 tokens: vllm #48391, #51187).
TOKEN_TILE = 256


@dataclass
class Variant:
    """A variant of the step's batch and, once run, how the recorded requests moved in it."""

    name: str
    kind: str
    description: str
    step: Step | None = None  # None: not applicable (see `reason`)
    reason: str | None = None
    num_tokens: int | None = None
    batch_order: list[str] = field(default_factory=list)  # as the runner ran it
    reordered_by_runner: bool = False  # the runner ran another order than the variant's (V2: decodes first)
    compared: list[str] = field(default_factory=list)  # the recorded requests it compared
    # req_id -> how its logits rows (and sampled ids) moved against the baseline
    moved: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def applicable(self) -> bool:
        return self.step is not None

    @property
    def invariant(self) -> bool:
        return not self.moved

    def to_plain(self) -> dict[str, Any]:
        plain = {name: value for name, value in vars(self).items() if name != "step"}
        return {**plain, "applicable": self.applicable, "invariant": self.invariant if self.applicable else None}


@dataclass
class InvarianceReport:
    bundle: str
    step: int
    runner: str
    engine_mode: str
    sampling: dict[str, str]  # req_id -> how its sampled ids are compared
    thresholds: dict[str, Any]
    baseline_reproduces_recording: bool | None
    variants: list[Variant]
    first_layer: dict[str, Any] | None = None  # the layer probe's finding, or why none
    notes: list[str] = field(default_factory=list)

    @property
    def invariant(self) -> bool:
        return all(outcome.invariant for outcome in self.variants if outcome.applicable)

    @property
    def first_broken(self) -> Variant | None:
        return next((outcome for outcome in self.variants if outcome.applicable and not outcome.invariant), None)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.invariant else EXIT_NOT_REPRODUCED

    def to_plain(self) -> dict[str, Any]:
        broken = self.first_broken
        return {
            "bundle": self.bundle,
            "step": self.step,
            "verdict": "invariant" if self.invariant else "not_invariant",
            "invariant": self.invariant,
            "exit_code": self.exit_code,
            "runner": self.runner,
            "engine_mode": self.engine_mode,
            "first_broken_variant": broken.name if broken else None,
            "first_layer": self.first_layer,
            "sampling": self.sampling,
            "thresholds": self.thresholds,
            "baseline_reproduces_recording": self.baseline_reproduces_recording,
            "variants": [outcome.to_plain() for outcome in self.variants],
            "notes": self.notes,
        }


def variant_kinds(text: str) -> tuple[str, ...]:
    """The variant kinds `--variants` names, comma separated ("all": every kind)."""
    kinds = VARIANT_KINDS if text == "all" else tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = sorted(set(kinds) - set(VARIANT_KINDS))
    if unknown or not kinds:
        raise UsageError(f"--variants: unknown kind(s) {unknown}; choose from {', '.join(VARIANT_KINDS)} or all")
    return kinds


def sampling_reproducible(request: RequestState) -> str | None:
    """How a request's sampled ids can be compared across batches, in words; None: they cannot."""
    params = request.sampling_params
    if params is not None and params.temperature < GREEDY_TEMPERATURE:
        return "greedy"
    if params is not None and params.seed is not None:
        return f"seeded ({params.seed})"
    if request.runner_state.get("seed") is not None:
        return "random with its recorded per-request seed (V2)"
    return None


def token_thresholds(step: Step, compile_range_ends: list[int], max_tokens: int) -> dict[str, Any]:
    """The token counts past which the engine may run the step with other kernels, and the
    filler targets (which: docs/GUIDE.md#batch-invariance, `fillers:N`)."""
    graph = step.graph
    tokens = step.num_real_rows
    sources = {
        "capture_sizes": sorted(set(graph.capture_sizes)),
        "compile_sizes": sorted({size for size in graph.compile_sizes if isinstance(size, int)}),
        "compile_range_ends": compile_range_ends,
        "multiples_of_256": list(range(TOKEN_TILE, max_tokens + TOKEN_TILE, TOKEN_TILE)),
    }
    above = sorted({size for sizes in sources.values() for size in sizes if size >= tokens})
    reachable = [size for size in above if size + 1 <= max_tokens]
    targets = [size + 1 for size in reachable[:MAX_FILLER_VARIANTS]]
    if not targets and max_tokens > tokens:
        targets = [max_tokens]
    return {
        "step_tokens": tokens,
        "max_num_batched_tokens": max_tokens,
        **sources,
        "unreachable": [size for size in above if size + 1 > max_tokens],
        "filler_targets": targets,
    }


def build_variants(step: Step, kinds: tuple[str, ...], thresholds: dict[str, Any], max_requests: int,
                   max_model_len: int, cached_prefix: dict[str, int]) -> list[Variant]:
    """The variants of `kinds`, in the order of VARIANT_KINDS; those that cannot be built say why
    (`cached_prefix`: req_id -> the prompt tokens it found in the prefix cache)."""
    order = list(step.batch_order)
    variants: list[Variant] = []

    max_tokens = thresholds["max_num_batched_tokens"]

    def add(name: str, kind: str, description: str, build: Callable[[], Step]) -> None:
        try:
            built = build()
        except UsageError as error:
            variants.append(Variant(name, kind, description, reason=str(error)))
            return
        if built.num_real_rows > max_tokens:
            variants.append(Variant(name, kind, description, reason=(
                f"it schedules {built.num_real_rows} tokens, more than the engine runs per step ({max_tokens})")))
        else:
            variants.append(Variant(name, kind, description, built))

    if "repeat" in kinds:
        variants.append(Variant("repeat", "repeat", "the recorded batch again (control)", step))
    if "alone" in kinds:
        for req_id in order:
            add(f"alone:{req_id}", "alone", f"{req_id} by itself", lambda r=req_id: batch_variants.alone(step, r))
    if "order" in kinds:
        if len(order) < 2:
            variants.append(Variant("order", "order", "the batch in other orders", reason="one request: no other order"))
        else:
            add("order:reversed", "order", "the batch reversed", lambda: batch_variants.reordered(step, order[::-1]))
            if len(order) > 2:
                add("order:rotated", "order", "the batch rotated by one",
                    lambda: batch_variants.reordered(step, order[1:] + order[:1]))
    if "fillers" in kinds:
        if not thresholds["filler_targets"]:
            variants.append(Variant("fillers", "fillers", "filler requests past the engine's thresholds",
                                    reason="the step already schedules the most tokens the engine runs per step"))
        for target in thresholds["filler_targets"]:
            extra = target - thresholds["step_tokens"]
            add(f"fillers:{target}", "fillers", f"{extra} filler token(s): {target} tokens in all",
                lambda e=extra: batch_variants.with_fillers(step, e, max_requests, max_model_len))
    if "recomputed" in kinds:
        if not cached_prefix:
            variants.append(Variant("recomputed", "recomputed", "prefix-cache hit vs recomputed KV",
                                    reason="no request of the step had its prompt prefix from the prefix cache"))
        for req_id, tokens in cached_prefix.items():
            add(f"recomputed:{req_id}", "recomputed", f"{req_id} computes its {tokens} cached prefix token(s) again",
                lambda r=req_id: batch_variants.recomputed(step, r))
    return variants


def logits_rows(observed: ObservedStep, step: Step) -> dict[str, slice]:
    """The rows of the observed logits each request's sampled tokens come from: one, and one more
    per draft it verifies, in the order the runner ran the batch. A runner computes them for every
    request, or for those that sample only (not a prefill chunk that ends before its prompt does)."""
    rows = 0 if observed.logits is None else int(observed.logits.shape[0])
    every = {req_id: 1 + len(step.request(req_id).draft_token_ids) for req_id in observed.batch_order}
    sampling = {req_id: count for req_id, count in every.items() if step.request(req_id).samples}
    for counts in (every, sampling):
        if rows == sum(counts.values()):
            starts = itertools.accumulate(counts.values(), initial=0)
            return {req_id: slice(start, start + count) for (req_id, count), start in zip(counts.items(), starts)}
    raise CannotRunHere(f"the replay produced {rows} logits row(s) for {len(observed.batch_order)} request(s)")


def _sampled(observed: ObservedStep) -> dict[str, list[int]]:
    return dict(zip(observed.batch_order, observed.sampled_token_ids or []))


def compare_requests(baseline: ObservedStep, base_step: Step, variant: ObservedStep, variant_step: Step,
                     reproducible: dict[str, str | None]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The recorded requests the variant ran, and for those that moved: their logits rows'
    comparison (max_abs, relative_rms, argmax_agreement) and, where compared, the sampled ids."""
    base_rows, variant_rows = logits_rows(baseline, base_step), logits_rows(variant, variant_step)
    base_sampled, variant_sampled = _sampled(baseline), _sampled(variant)
    compared, moved = [], {}
    for req_id in variant.batch_order:
        if batch_variants.is_filler(req_id) or req_id not in base_rows:
            continue
        compared.append(req_id)
        comparison = compare_tensors(variant.logits[variant_rows[req_id]], baseline.logits[base_rows[req_id]])
        entry: dict[str, Any] = {}
        if not comparison.pop("bit_exact"):
            entry["logits"] = comparison
        if reproducible.get(req_id) and base_sampled.get(req_id) != variant_sampled.get(req_id):
            entry["sampled"] = {"baseline": base_sampled.get(req_id), "variant": variant_sampled.get(req_id)}
        if entry:
            moved[req_id] = entry
    return compared, moved


def _token_rows(observed: ObservedStep, step: Step, req_id: str, count: int) -> slice:
    """The last `count` token rows of `req_id` in a forward that ran `observed.batch_order`."""
    runs = dict(zip(observed.batch_order, token_runs([step.request(other) for other in observed.batch_order])))
    return slice(runs[req_id].stop - count, runs[req_id].stop)


def first_moved_layer(replayer: Any, base_step: Step, variant_step: Step, req_id: str) -> dict[str, Any]:
    """Run the baseline and a variant again capturing every module's output, and name the first
    module (in forward order) whose rows for `req_id` differ."""
    engine = replayer.engine()
    captured: list[dict[str, torch.Tensor]] = []
    observed = []
    for step in (base_step, variant_step):
        outputs: dict[str, torch.Tensor] = {}

        def on_forward(handle: Any, into: dict = outputs) -> None:
            capture = engine.capture_layers(handle)
            if capture.failure is not None:
                raise CannotRunHere(f"per-layer capture failed: {capture.failure}")
            into.update(capture.outputs)

        observed.append(replayer.run(step, on_forward))
        captured.append(outputs)
    count = base_step.request(req_id).num_scheduled_tokens
    base_rows = _token_rows(observed[0], base_step, req_id, count)
    variant_rows = _token_rows(observed[1], variant_step, req_id, count)
    base_tokens, variant_tokens = base_step.num_real_rows, variant_step.num_real_rows
    for name, before in captured[0].items():
        after = captured[1].get(name)
        if after is None or before.dim() == 0 or before.shape[0] != base_tokens or after.shape[0] != variant_tokens:
            continue
        comparison = compare_tensors(after[variant_rows], before[base_rows])
        if not comparison.pop("bit_exact"):
            return {"module": name, "request": req_id, **comparison}
    return {"module": None, "request": req_id,
            "reason": "every module's output for the request is bit-identical in the eager forwards"}


def check_invariance(
    bundle: str | Path,
    *,
    kinds: str = "all",
    step: int | None = None,
    model: str | None = None,
    allow_weights_mismatch: bool = False,
    llm: Any = None,
    on_variant: Callable[[Variant], None] | None = None,
) -> InvarianceReport:
    """Replay the bundle's step and its variants of `kinds` (the `--variants` text) on one engine
    (built once, or `llm`)."""
    from tracekit.format.content import load_step
    from tracekit.integrations.vllm.replay_engine import require_drafting_known, require_replayable_kind
    from tracekit.share.shrink_trials import EngineReplayer

    kinds = variant_kinds(kinds)
    content, recorded = load_step(bundle, step)
    if content.parallel.multi_rank:
        raise CannotRunHere("a multi-rank step's variants are not supported yet: its ranks run one batch together")
    if recorded.error is not None:
        raise UsageError(f"{bundle} holds a step whose forward raised: it has no outputs to compare across batches")
    require_drafting_known(bundle, content, recorded, {})
    fill_drafts_from_inputs(recorded)  # the variants' inputs hold each drafted request's drafts
    require_replayable_kind(recorded)
    with closing(EngineReplayer(content, recorded, llm, model, allow_weights_mismatch)) as replayer:
        return _check_variants(bundle, kinds, content, recorded, replayer, on_variant)


def _check_variants(bundle: str | Path, kinds: tuple[str, ...], content: Any, recorded: Step, replayer: Any,
                    on_variant: Callable[[Variant], None] | None) -> InvarianceReport:
    """The baseline and every variant of `kinds`, run by `replayer`; the first broken variant's layer."""
    args = content.engine.engine_args
    adapter = replayer.engine().adapter
    max_tokens = int(args.get("max_num_batched_tokens") or recorded.num_real_rows)
    thresholds = token_thresholds(recorded, adapter.compile_range_ends if adapter.compiled else [], max_tokens)
    cached = {req_id: tokens for req_id, tokens in prefix_cache_hits(recorded.scheduler_output).items()
              if req_id in recorded.batch_order}
    variants = build_variants(recorded, kinds, thresholds, int(args.get("max_num_seqs") or len(recorded.requests)),
                              int(args.get("max_model_len") or max_tokens + 1), cached)

    baseline = replayer.run(recorded, None)
    reproduces = None
    notes = []
    if recorded.outputs is not None:
        diverged = first_divergence(check_step(baseline, recorded))
        reproduces = diverged is None
        if diverged is not None:
            notes.append(f"the replay here does not reproduce the recording (first divergence: {diverged.name}); "
                         "the variants are compared with the replay here")
    reproducible = {request.req_id: sampling_reproducible(request) for request in recorded.requests}
    for variant in variants:
        if variant.applicable:
            observed = replayer.run(variant.step, None)
            variant.compared, variant.moved = compare_requests(baseline, recorded, observed, variant.step, reproducible)
            variant.num_tokens, variant.batch_order = variant.step.num_real_rows, list(observed.batch_order)
            variant.reordered_by_runner = observed.batch_order != variant.step.batch_order
        if on_variant is not None:
            on_variant(variant)
    report = InvarianceReport(
        bundle=str(bundle), step=recorded.index, runner=content.engine.runner, engine_mode=adapter.reference_mode,
        sampling={req_id: reproducible[req_id] or "not compared: unseeded random sampling draws from a generator the "
                  "batch shares (logits compared)" for req_id in recorded.batch_order},
        thresholds=thresholds, baseline_reproduces_recording=reproduces, variants=variants, notes=notes,
    )
    broken = report.first_broken
    if broken is not None:
        if adapter.reference_mode != "eager":
            report.first_layer = {"module": None, "reason": (
                "the layer probe captures an eager forward, and this engine runs compiled (another forward): "
                "record the step with --enforce-eager to find the layer")}
        else:
            report.first_layer = first_moved_layer(replayer, recorded, broken.step, next(iter(broken.moved)))
    return report
