"""What a bundle holds, summarized for a person or a tool (`tracekit inspect`), without loading
its tensors: it reads the header, index and metadata only (tensors stay compressed on disk), so it
is fast on a multi-GiB bundle and needs neither torch nor vLLM. It opens with what the bundle
needs of the machine that replays it (`needs`).
"""

import os
from pathlib import Path
from typing import Any

from tracekit.environment import numerics_summary
from tracekit.errors import BundleError
from tracekit.format import open_bundle
from tracekit.format.rankset import find_rank_set
from tracekit.format.schema import BundleContent
from tracekit.format.untrusted import is_tensor_ref
from tracekit.integrations.vllm.records.needs import bundle_needs
from tracekit.integrations.vllm.records.step_features import not_replayable_reason


def summarize(bundle: str | Path, full: bool = False, verify: bool = False) -> dict[str, Any]:
    """The summary of `bundle` (`full`: with its whole content; `verify`: every part checked,
    what is damaged listed under "verify": `damage` makes it the error to exit with)."""
    with open_bundle(bundle) as reader:
        summary = summary_of(reader, full)
        if verify:
            report = reader.verify()
            summary["verify"] = {"ok": report.ok, "parts_checked": len(report.parts_checked), "damaged": report.damaged}
    return summary


def damage(summary: dict[str, Any]) -> BundleError | None:
    """What a verified summary found damaged, as the error to exit with (None: intact or not verified)."""
    verified = summary.get("verify")
    if verified is None or verified["ok"]:
        return None
    part, problem = next(iter(verified["damaged"].items()))
    more = f" (and {len(verified['damaged']) - 1} more damaged part(s))" if len(verified["damaged"]) > 1 else ""
    return BundleError(f"bundle {os.path.basename(summary['path'])} is damaged: {part} {problem}{more}")


def listed(value) -> list:
    """A list from a part of the bundle the schema leaves open, or nothing when it holds
    something else there."""
    return value if isinstance(value, list) else []


def _tensor_summaries(value, infos: dict):
    """The metadata tree with every tensor reference replaced by what the index says of it."""
    if is_tensor_ref(value):
        info = infos.get(value["$tensor"])
        return {"tensor": value["$tensor"], "dtype": info and info.dtype, "shape": info and list(info.shape)}
    if isinstance(value, dict):
        return {key: _tensor_summaries(item, infos) for key, item in value.items()}
    if isinstance(value, list):
        return [_tensor_summaries(item, infos) for item in value]
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    return value


def summary_of(reader, full: bool = False) -> dict:
    """The summary of an open bundle (`summarize` opens it)."""
    summary = {
        "path": reader.path,
        "file_bytes": os.path.getsize(reader.path),
        "format_version": reader.format_version,
        "min_reader_version": reader.min_reader_version,
        "writer": reader.header.get("writer"),
    }
    tensors = [{"name": info.name, "dtype": info.dtype, "shape": list(info.shape), "nbytes": info.nbytes,
                "stored_nbytes": info.stored_nbytes, "filter": info.filter, "codec": info.codec}
               for info in reader.tensor_infos()]
    metadata = reader.metadata  # a damaged metadata frame raises here
    if not BundleContent.claimed_by(metadata):
        summary["content"] = "not a recorded engine step (its metadata holds none of the content's fields)"
        return {**summary, "tensors": tensors}
    content = BundleContent.from_plain(metadata)  # a recorded step of wrong types or values raises here
    summary = {"needs": bundle_needs(content, reader.path).to_plain(), **summary}
    summary.update(_recording(content))
    if full:
        summary["content"] = _tensor_summaries(metadata, {info.name: info for info in reader.tensor_infos()})
    if content.parallel.multi_rank:
        summary["rank_set"] = {"this_rank": content.parallel.rank, **find_rank_set(reader.path).to_plain()}
    summary["steps"] = [_step_summary(step) for step in content.steps]
    return {**summary, "tensors": tensors}


def _recording(content: BundleContent) -> dict[str, Any]:
    """Where and how the bundle was recorded, and what was done to it since."""
    environment, model = content.environment, content.engine.model
    recording = {
        "environment": {key: getattr(environment, key)
                        for key in ("tracekit_version", "vllm_version", "torch_version", "python_version", "platform",
                                    "device_kind", "device_name", "cpu_isa", "gpu_capability")},
        "numerics": numerics_summary(environment),
        "model": {"path": model.path, "architecture": model.architecture, "runner": content.engine.runner},
    }
    draft = content.engine.draft_model
    if draft is not None:
        recording["draft_model"] = {"path": draft.path, "architecture": draft.architecture}
    return {**recording, "created_at": content.created_at, "derivations": content.derivations,
            "redacted": any(entry.get("kind") == "redact" for entry in content.derivations)}


def _step_summary(step) -> dict[str, Any]:
    return {
        "index": step.index,
        "trigger": step.trigger,
        "requests": [
            {"req_id": request.req_id, "num_scheduled_tokens": request.num_scheduled_tokens,
             "num_computed_tokens": request.num_computed_tokens,
             "num_prompt_tokens": len(request.prompt_token_ids),
             "num_output_tokens": len(request.output_token_ids),
             "num_draft_tokens": len(request.draft_token_ids),
             "phase": "prefill" if request.is_prefill else "decode"}
            for request in step.requests
        ],
        "spec_decode": _spec_decode_summary(step),
        "dispatch": {
            "compilation_mode": step.graph.compilation_mode, "cudagraph_mode": step.graph.cudagraph_mode,
            "runtime_mode": step.graph.runtime_mode, "num_tokens": step.graph.num_tokens,
            "num_tokens_padded": step.graph.num_tokens_padded, "capture_sizes": step.graph.capture_sizes,
        },
        "kv": {"mode": step.kv.mode, **{f"blocks_{which}": sum(len(getattr(group, f"{which}_block_ids"))
                                                               for group in step.kv.groups)
                                        for which in ("read", "written", "saved")}},
        "timing_us": {"forward": step.timing.forward_us, "step": step.timing.step_us},
        "outputs_finite": step.outputs.finite if step.outputs is not None else None,
        "error": {key: step.error.get(key) for key in ("type", "message", "phase")} if step.error is not None else None,
        "window": _window_summary(step),
        "grammar": {"requests": step.grammar.request_ids, "rows": sum(step.grammar.rows_per_request)}
        if step.grammar is not None else None,
        "lora_adapters": [
            {"name": adapter.name, "slot": adapter.slot, "rank": adapter.rank, "fingerprint": adapter.fingerprint,
             "size_bytes": adapter.size_bytes, "kept": bool(adapter.files)}
            for adapter in step.lora_adapters
        ],
        "features": step.features,
        "cannot_replay_yet": not_replayable_reason(step),
    }


def _spec_decode_summary(step) -> dict | None:
    """Speculative decoding in the step: the method, drafts verified and accepted (the sampled ids
    of a drafted request are its accepted drafts and one token more), the drafter's model calls."""
    record = step.spec_decode
    if record is None:
        return None
    sampled = step.outputs.sampled_token_ids if step.outputs is not None else None
    accepted = None
    if sampled is not None and len(sampled) >= len(step.batch_order):
        accepted = sum(step.accepted_drafts(sampled).values())
    return {"method": record.method, "num_speculative_tokens": record.num_speculative_tokens,
            "drafts": sum(len(request.draft_token_ids) for request in step.requests), "accepted": accepted,
            "drafter_calls": len(record.drafter_calls), "proposals": record.proposals is not None}


def _window_summary(step) -> dict | None:
    """The steps a step's window holds after it (`record --window`), each in a line's worth."""
    if not step.later:
        return None
    calls = [(call["call"], call["step"]) for call in step.runner_calls]
    overlap = any(("execute", index + 1) in calls and ("output", index) in calls
                  and calls.index(("output", index)) > calls.index(("execute", index + 1))
                  for index in step.window_indices)
    return {
        "steps": step.window_indices,
        "requested": step.steps_requested,
        "held_requests": [request.req_id for request in step.held_requests],
        "outputs_read_after_the_next_step": overlap,
        "later": [
            {"index": carried.index, "requests": len(carried.batch_order),
             "tokens": carried.graph.num_tokens if carried.graph is not None else None,
             "runtime_mode": carried.graph.runtime_mode if carried.graph is not None else None,
             "num_tokens_padded": carried.graph.num_tokens_padded if carried.graph is not None else None,
             "forward_us": carried.timing.forward_us,
             "error": carried.error.get("type") if carried.error is not None else None}
            for carried in step.later
        ],
    }
