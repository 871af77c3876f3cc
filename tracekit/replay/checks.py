"""Comparing a replayed step with what the engine recorded, item by item, in forward order: the
first one that differs is where to start looking (if the KV written differs, the hidden states
will too). Per-layer outputs (`--layers`) are checked apart, in the order the forward ran them.
The padding rows of a graph step are compared apart, as items that do not decide, and what they
may have done to the real rows is named (docs/GUIDE.md, "What a GPU step holds").
"""

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from tracekit.format.schema import KVWritten, Step
from tracekit.integrations.seam import ObservedStep
from tracekit.integrations.vllm.replay_engine import STATEFUL_DRAFTERS, logits_rows, unpack_mask
from tracekit.numerics import compare_tensors


@dataclass
class CheckedItem:
    name: str
    bit_exact: bool
    within_tolerance: bool
    details: dict[str, Any]
    # The recorded tensor's dtype for float items ("float32", "bfloat16", ...); None for discrete
    # items (batch order, ids, positions, sampled ids), which must be equal on any platform.
    float_dtype: str | None = None
    # Whether the item decides the verdict (padding rows do not).
    decides: bool = True
    # A digest of float data (`kv_written`): equal or not, with no magnitude to hold against a
    # tolerance or a platform's bound; those verdicts go by the float items it summarises.
    digest_only: bool = False
    # What the replay produced for the item, digested (`replayed_digest`; None: nothing): two
    # replays of a step produced the same item exactly when these are equal.
    replayed: str | None = None

    @property
    def is_padding(self) -> bool:
        """Rows beyond the step's real ones, compared apart (`name/padding`)."""
        return self.name.endswith(PADDING)

    def to_plain(self) -> dict[str, Any]:
        plain = {"item": self.name, "bit_exact": self.bit_exact, "within_tolerance": self.within_tolerance}
        if self.float_dtype is not None:
            plain["dtype"] = self.float_dtype
        if not self.decides:
            plain["decides"] = False
        return {**plain, **self.details}


PADDING = "/padding"  # suffix of the items that compare padding rows


def replayed_digest(value: Any) -> str | None:
    """What a replay produced for an item (a tensor, ids, a per-request map, ...), as a short
    digest of its exact bits (dtype and shape included): replays of one step are compared with
    each other so (`tracekit.replay.repeats`). None where the replay produced nothing."""
    if value is None:
        return None
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.hexdigest()[:16]


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        hasher.update(f"tensor {flat.dtype} {list(value.shape)};".encode())
        hasher.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        hasher.update(f"map {len(value)};".encode())
        for key in sorted(value, key=str):
            _feed(hasher, key)
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"list {len(value)};".encode())
        for element in value:
            _feed(hasher, element)
    elif hasattr(value, "__dict__"):
        _feed(hasher, vars(value))
    else:
        hasher.update(f"{type(value).__name__} {value!r};".encode())


def _tensor_item(name: str, actual: Any, expected: Any, tolerance: float) -> CheckedItem | None:
    if expected is None:
        return None
    floating = expected.is_floating_point()
    dtype = str(expected.dtype).removeprefix("torch.") if floating else None
    if actual is None:
        return CheckedItem(name, False, False, {"problem": "not produced by the replay"}, dtype)
    details = compare_tensors(actual, expected)
    bit_exact = details.pop("bit_exact")
    if floating and actual.is_floating_point():
        nonfinite = {"recorded": int((~torch.isfinite(expected)).sum()), "replayed": int((~torch.isfinite(actual)).sum())}
        if any(nonfinite.values()):
            details["nonfinite"] = nonfinite
    within = bit_exact or (
        floating and "shape_mismatch" not in details and details["relative_rms"] <= tolerance
    )
    return CheckedItem(name, bit_exact, within, details, dtype, replayed=replayed_digest(actual))


def _exact_item(name: str, actual: Any, expected: Any) -> CheckedItem | None:
    """A discrete item, equal or not; where a list differs, how much of it agrees and where it
    first differs; where a per-request map differs, the requests that do with both values."""
    if expected is None:
        return None
    same = actual == expected
    details: dict[str, Any] = {}
    if not same and isinstance(expected, dict):
        details["requests_moved"] = {
            req_id: {"recorded": value, "replayed": actual.get(req_id)}
            for req_id, value in expected.items() if actual.get(req_id) != value
        }
    elif not same and isinstance(expected, list):
        pairs = list(zip(actual or [], expected))
        details["agreement"] = sum(a == e for a, e in pairs) / max(len(expected), 1)
        details["first_difference"] = next(
            (i for i, (a, e) in enumerate(pairs) if a != e), min(len(actual or []), len(expected))
        )
    return CheckedItem(name, same, same, details, replayed=replayed_digest(actual))


# vLLM treats a temperature below this as greedy sampling.
GREEDY_TEMPERATURE = 1e-5


def _sampled_item(observed: ObservedStep, step: Step) -> CheckedItem | None:
    """Sampled ids must be equal; where a greedy request's differ, how close its recorded logits
    were to a tie between the top two (a margin below twice the logits' move here can flip an
    argmax). A random draw depends on every probability, so no margin says it for those."""
    outputs = step.outputs
    item = _exact_item("sampled_token_ids", observed.sampled_token_ids, outputs.sampled_token_ids)
    if item is None or item.bit_exact:
        return item
    logits_delta = None
    if observed.logits is not None and outputs.logits is not None and observed.logits.shape == outputs.logits.shape:
        logits_delta = (observed.logits.double() - outputs.logits.double()).abs()
    rows = []
    replayed = observed.sampled_token_ids or []
    params = {request.req_id: request.sampling_params for request in step.requests}
    for row, recorded_ids in enumerate(outputs.sampled_token_ids):
        here = replayed[row] if row < len(replayed) else None
        if here == recorded_ids:
            continue
        req_id = step.batch_order[row] if row < len(step.batch_order) else None
        temperature = params[req_id].temperature if params.get(req_id) is not None else None
        greedy = temperature is not None and temperature < GREEDY_TEMPERATURE
        entry: dict[str, Any] = {
            "row": row,
            "req_id": req_id,
            "recorded": recorded_ids,
            "replayed": here,
            "sampling": "greedy" if greedy else f"random (temperature {temperature})",
        }
        if outputs.logits is not None and row < outputs.logits.shape[0] and outputs.logits.shape[-1] > 1:
            top2 = torch.topk(outputs.logits[row].double(), 2).values
            entry["top2_margin"] = float(top2[0] - top2[1])
            if logits_delta is not None:
                # Two logits each moving by up to d can close a margin of up to 2d.
                entry["logits_max_abs_here"] = float(logits_delta[row].max())
                if greedy:
                    entry["near_tie"] = entry["top2_margin"] <= 2 * entry["logits_max_abs_here"]
        rows.append(entry)
    item.details["differing_rows"] = rows
    return item


# The tokens named per differing row of the grammar mask.
TOKENS_NAMED = 8


def _grammar_item(observed: ObservedStep, step: Step) -> CheckedItem | None:
    """The grammar mask as it reached the logits must be equal, row for row; where a row
    differs, whose row it is (the request, and the position: 0 its sampled token, i its i-th
    draft) and which tokens only the recording or only the replay left unmasked."""
    here, recorded = observed.grammar_bitmask, step.outputs.grammar_bitmask
    if recorded is None:
        return None
    if here is None:
        return CheckedItem("grammar_bitmask", False, False, {"problem": "no grammar mask reached the replay's logits"})
    if here.shape != recorded.shape:
        return CheckedItem("grammar_bitmask", False, False,
                           {"shape_mismatch": [list(here.shape), list(recorded.shape)]}, replayed=replayed_digest(here))
    if torch.equal(here, recorded):
        return CheckedItem("grammar_bitmask", True, True, {}, replayed=replayed_digest(here))
    outputs = step.outputs
    vocab = outputs.logits.shape[-1] if outputs.logits is not None else here.shape[1] * 32
    owners = logits_rows(step)
    allowed_here, allowed_recorded = unpack_mask(here, vocab), unpack_mask(recorded, vocab)
    rows = []
    for row in torch.nonzero((here != recorded).any(dim=1)).flatten().tolist():
        only_recorded = torch.nonzero(allowed_recorded[row] & ~allowed_here[row]).flatten().tolist()
        only_here = torch.nonzero(allowed_here[row] & ~allowed_recorded[row]).flatten().tolist()
        req_id, position = owners[row] if row < len(owners) else (None, None)
        rows.append({
            "row": row, "req_id": req_id, "position": position,
            "allowed_only_recorded": len(only_recorded), "allowed_only_here": len(only_here),
            "tokens_only_recorded": only_recorded[:TOKENS_NAMED], "tokens_only_here": only_here[:TOKENS_NAMED],
        })
    return CheckedItem("grammar_bitmask", False, False, {"differing_mask_rows": rows}, replayed=replayed_digest(here))


def _row_items(name: str, actual: Any, expected: Any, step: Step, tolerance: float) -> list[CheckedItem | None]:
    """The real rows of a per-token tensor as `name` (they decide); rows past the scheduled
    tokens — padding, present when the step ran at a padded size — as `name/padding` (they do
    not). Real rows that differ are named by request (`requests_moved`: req_id -> max abs)."""
    real = step.num_real_rows
    if expected is None or expected.dim() == 0 or actual is None or actual.dim() == 0 or actual.shape[0] < real:
        return [_tensor_item(name, actual, expected, tolerance)]
    items = [_tensor_item(name, actual[:real], expected[:real], tolerance)]
    if not items[0].bit_exact and actual.shape[1:] == expected.shape[1:]:
        items[0].details["requests_moved"] = _requests_moved(actual[:real], expected[:real], step)
    if expected.shape[0] > real:
        items.append(_padding_item(name, actual[real:], expected[real:], tolerance, [real, int(expected.shape[0])]))
    return items


def _padding_item(name: str, actual: Any, expected: Any, tolerance: float, rows: list[int]) -> CheckedItem:
    """Rows past the step's real ones (`rows`: which), compared apart as `name/padding`: they do not decide."""
    padding = _tensor_item(name + PADDING, actual, expected, tolerance)
    padding.decides = False
    padding.details["rows"] = rows
    return padding


def _requests_moved(actual: torch.Tensor, expected: torch.Tensor, step: Step) -> dict[str, float]:
    """For each request whose rows differ, the largest absolute difference in them."""
    moved = {}
    for req_id, rows in step.request_rows().items():
        here, there = actual[rows.start:rows.stop], expected[rows.start:rows.stop]
        if here.numel() and not torch.equal(here, there):
            moved[req_id] = float((here.double() - there.double()).abs().nan_to_num(nan=float("inf")).max())
    return moved


KV_DIGEST_ITEM = "kv_written"


def _kv_digest_item(observed: ObservedStep, recorded: list[KVWritten], step: Step) -> CheckedItem | None:
    """A window's later step: the digest of the KV it wrote, per KV cache group, layer and request,
    against the recorded one. Where it differs, each request whose KV differs with the first layer
    where it does (`requests_moved`), and how many layers differ. A digest the replay could not
    take, or a recorded one of another shape (a damaged bundle), is named and does not decide."""
    if not recorded:
        return None
    here = observed.kv_written
    problem = None
    if len(here) != len(recorded):
        problem = "the replay could not digest the KV it wrote (a cache layout tracekit does not know, or positions not one per row)"
    moved: dict[str, str] = {}
    layers_moved = 0
    for group, (mine, theirs) in enumerate(zip(here, recorded)):
        rows = {name: row for name, row in zip(mine.layer_names, mine.digests)}
        shape = tuple(getattr(theirs.digests, "shape", ()))
        if shape != (len(theirs.layer_names), len(step.batch_order)) or not set(theirs.layer_names) <= rows.keys():
            problem = f"KV cache group {group}: the recorded digest (shape {list(shape)}) is not one per layer and request"
            break
        for name, recorded_row in zip(theirs.layer_names, theirs.digests):
            differs = (rows[name] != recorded_row.to(rows[name].dtype)).tolist()
            layers_moved += any(differs)
            for req_id, moved_here in zip(step.batch_order, differs):
                if moved_here and (req_id not in moved or _model_order(name) < _model_order(moved[req_id])):
                    moved[req_id] = name  # the first layer in the model, whichever group holds it
    if problem is not None:
        return CheckedItem(KV_DIGEST_ITEM, False, False, {"problem": problem}, decides=False, digest_only=True)
    details = {"requests_moved": moved, "layers_moved": layers_moved} if moved else {}
    return CheckedItem(KV_DIGEST_ITEM, not moved, not moved, details, digest_only=True, replayed=replayed_digest(here))


def _model_order(layer_name: str) -> list[tuple[int, int | str]]:
    """A layer's place in the model from its name (`model.layers.10.self_attn.attn` after
    `model.layers.9...`): KV cache groups list their layers group by group, not in model order."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in layer_name.split(".")]


def check_step(observed: ObservedStep, step: Step, tolerance: float = 0.0,
               kv_written: list[KVWritten] | None = None) -> list[CheckedItem]:
    """Every comparable item, in forward order; tolerance is a relative RMS for float tensors.
    `kv_written`: a window's later step's recorded digest of the KV it wrote."""
    items = [
        _exact_item("batch_order", observed.batch_order, step.batch_order),
        _drafts_item(observed, step),
        *_row_items("input_ids", observed.input_ids, step.input_ids, step, 0.0),
        *_row_items("positions", observed.positions, step.positions, step, 0.0),
        _kv_digest_item(observed, kv_written or [], step),
    ]
    for group_index, group in enumerate(step.kv.groups):
        live = observed.kv_after[group_index] if group_index < len(observed.kv_after) else {}
        for layer, expected in group.after.items():
            item = _tensor_item(f"kv_written/{layer}", live.get(layer), expected, tolerance)
            actual = live.get(layer)
            if item is not None and not item.bit_exact and actual is not None and actual.shape == expected.shape:
                item.details["blocks_moved"] = [
                    block for row, block in enumerate(group.written_block_ids)
                    if not torch.equal(actual.select(group.layout.block_dim, row), expected.select(group.layout.block_dim, row))
                ]
            items.append(item)
    outputs = step.outputs
    if outputs is not None:
        items.extend(_row_items("hidden_states", observed.hidden_states, outputs.hidden_states, step, tolerance))
        items.append(_tensor_item("logits", observed.logits, outputs.logits, tolerance))
        items.append(_grammar_item(observed, step))
        items.append(_accepted_item(observed, step))
        items.append(_sampled_item(observed, step))
    items.extend(_drafter_items(observed, step, tolerance))
    return [item for item in items if item is not None]


def _drafts_item(observed: ObservedStep, step: Step) -> CheckedItem | None:
    """The drafts the replayed forward verified (its input ids at each drafted request's draft
    rows) against those the recorded forward verified (the recorded input ids there)."""
    if not any(request.draft_token_ids for request in step.requests):
        return None
    expected = (step.drafts_in(step.input_ids.tolist()) if step.input_ids is not None
                else {request.req_id: request.draft_token_ids for request in step.requests if request.draft_token_ids})
    actual = step.drafts_in(observed.input_ids.tolist()) if observed.input_ids is not None else {}
    return _exact_item("spec_decode/drafts", actual, expected)


def _accepted_item(observed: ObservedStep, step: Step) -> CheckedItem | None:
    """How many drafts the rejection sampler accepted per drafted request (its sampled ids are the
    accepted drafts and one token more): its decision, apart from the token it then drew."""
    recorded = step.outputs.sampled_token_ids
    if recorded is None or not any(request.draft_token_ids for request in step.requests):
        return None
    replayed = observed.sampled_token_ids or []
    return _exact_item("spec_decode/accepted", step.accepted_drafts(replayed), step.accepted_drafts(recorded))


def _chosen_rows_items(name: str, actual: Any, expected: Any, rows: list[int], tolerance: float) -> list[CheckedItem | None]:
    """`rows` of a tensor as `name` (they decide), its other rows as `name/padding` (they do not)."""
    if expected is None or expected.dim() == 0 or actual is None or actual.shape[:1] != expected.shape[:1] \
            or (rows and max(rows) >= expected.shape[0]):
        return [_tensor_item(name, actual, expected, tolerance)]
    chosen = torch.tensor(rows, dtype=torch.long)
    others = torch.tensor(sorted(set(range(expected.shape[0])) - set(rows)), dtype=torch.long)
    items = [_tensor_item(name, actual.index_select(0, chosen), expected.index_select(0, chosen), tolerance)]
    if len(others):
        items.append(_padding_item(name, actual.index_select(0, others), expected.index_select(0, others), tolerance,
                                   others.tolist()))
    return items


def _drafter_items(observed: ObservedStep, step: Step, tolerance: float) -> list[CheckedItem | None]:
    """The drafter's model calls (inputs, the target hidden states it read, outputs; real rows
    decide) and its proposals for the next step."""
    record = step.spec_decode
    if record is None or step.outputs is None:
        return []
    items: list[CheckedItem | None] = []
    for index, recorded in enumerate(record.drafter_calls):
        here = observed.drafter_calls[index] if index < len(observed.drafter_calls) else None
        rows = step.drafter_rows(index)
        for field_name in ("input_ids", "positions", "hidden_states_in", "hidden_states"):
            expected = getattr(recorded, field_name)
            actual = getattr(here, field_name) if here is not None else None
            tolerance_here = tolerance if field_name.startswith("hidden") else 0.0
            items.extend(_chosen_rows_items(f"drafter/{index}/{field_name}", actual, expected, rows, tolerance_here))
    if record.proposals is not None:
        actual = observed.proposals.to(torch.int64) if observed.proposals is not None else None
        item = _tensor_item("spec_decode/proposals", actual, record.proposals.to(torch.int64), 0.0)
        if not item.bit_exact and actual is not None and actual.shape == record.proposals.shape:
            item.details["requests_moved"] = [
                req_id for req_id, here, there in zip(step.batch_order, actual, record.proposals.to(torch.int64))
                if not torch.equal(here, there)
            ]
        if record.method in STATEFUL_DRAFTERS:
            item.decides = False
            item.details["why_not_deciding"] = f"the {record.method} drafter proposes from state kept across requests"
        if observed.drafter_orders_dropped:
            item.decides = False
            item.details["why_not_deciding"] = (
                f"the recording's scheduler told its drafter {', '.join(observed.drafter_orders_dropped)}, "
                "which this vLLM has no field for: its drafter proposed as it does itself")
        items.append(item)
    return items


def padding_findings(observed: ObservedStep, step: Step) -> list[str]:
    """What the padding rows of a graph step may have done to its real outputs, in words
    (docs/GUIDE.md, "What a GPU step holds"; a phantom row's NaN reaches real rows through any
    cross-row op)."""
    findings = []
    real = step.num_real_rows
    for source, hidden in (("replayed", observed.hidden_states),
                           ("recorded", step.outputs.hidden_states if step.outputs is not None else None)):
        if hidden is None or not hidden.is_floating_point() or hidden.shape[0] <= real:
            continue
        bad_rows = int((~torch.isfinite(hidden[real:])).flatten(1).any(dim=1).sum())
        if bad_rows:
            reached = not bool(torch.isfinite(hidden[:real]).all())
            findings.append(
                f"{source} hidden states: {bad_rows} of {hidden.shape[0] - real} padding row(s) hold NaN/inf"
                + ("; the real rows are not finite either: a phantom row's value may have reached them"
                   if reached else "; the real rows are finite")
            )
    for group, blocks in zip(step.kv.groups, observed.kv_changed_elsewhere):
        if blocks:
            findings.append(
                f"the replayed forward wrote KV block(s) {blocks[:8]}{'...' if len(blocks) > 8 else ''} of "
                f"{group.layer_names[0]}'s group, which no token of the step owns (a padding slot's write?)"
            )
    return findings


LAYER_PREFIX = "layer/"  # of the items that check one module's output


def check_layers(replayed: dict[str, Any], recorded: dict[str, Any], tolerance: float = 0.0) -> list[CheckedItem]:
    """Per-module outputs of an eager forward against those recorded, in recorded (forward) order."""
    return [_tensor_item(LAYER_PREFIX + name, replayed.get(name), expected, tolerance)
            for name, expected in recorded.items()]


# The item of a step's error (a step recorded because it raised, or one that raised in the replay).
ERROR_ITEM = "error"


def error_item(step: Step, raised: BaseException | None) -> CheckedItem:
    """A step recorded because it raised (in its forward, logits, sampling or bookkeeping)
    reproduces when it raises the same again (`raised`: what the replay raised, None: nothing)."""
    recorded = {"recorded": f"{step.error.get('type')}: {step.error.get('message')}",
                "recorded_phase": step.error.get("phase", "forward")}
    if raised is None:
        return CheckedItem(ERROR_ITEM, False, False, {"raised": None, "problem": "the step did not raise", **recorded})
    same = type(raised).__name__ == step.error.get("type") and str(raised) == step.error.get("message")
    said = f"{type(raised).__name__}: {raised}"
    return CheckedItem(ERROR_ITEM, same, same, {"raised": said, **recorded}, replayed=replayed_digest(said))


def first_divergence(items: list[CheckedItem]) -> CheckedItem | None:
    return next((item for item in items if item.decides and not item.within_tolerance), None)
