"""`tracekit inspect BUNDLE`: what a bundle holds, as a table or JSON, without loading tensors.

It reads the header, index and metadata only (tensors stay compressed on disk), so it is fast
on a multi-GiB bundle and runs without torch or vLLM. `--verify` decodes every part and checks
every hash; a damaged bundle then exits with code 2. `--json --full` adds the whole recorded
content (scheduler output, request states, ...) as plain JSON, tensors as name/dtype/shape.
Every string from the bundle is shown escaped (rich markup, ANSI and other control
characters), and tables stop after `MAX_TABLE_ROWS` rows (`--json` lists everything).
"""

import json
import os

import click

from tracekit.cli.terminal import inert
from tracekit.environment import numerics_summary
from tracekit.errors import BundleError, UsageError
from tracekit.format import open_bundle
from tracekit.format.rankset import find_rank_set
from tracekit.format.schema import BundleContent
from tracekit.format.untrusted import is_tensor_ref
from tracekit.integrations.vllm.records.step_features import not_replayable_reason

MAX_TABLE_ROWS = 200


def _listed(value) -> list:
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


def _summary(reader, full: bool = False) -> dict:
    summary = {
        "path": reader.path,
        "file_bytes": os.path.getsize(reader.path),
        "format_version": reader.format_version,
        "min_reader_version": reader.min_reader_version,
        "writer": reader.header.get("writer"),
        "tensors": [
            {"name": info.name, "dtype": info.dtype, "shape": list(info.shape), "nbytes": info.nbytes,
             "stored_nbytes": info.stored_nbytes, "filter": info.filter, "codec": info.codec}
            for info in reader.tensor_infos()
        ],
    }
    metadata = reader.metadata  # a damaged metadata frame raises here
    if not BundleContent.claimed_by(metadata):
        summary["content"] = "not a recorded engine step (its metadata holds none of the content's fields)"
        return summary
    content = BundleContent.from_plain(metadata)  # a recorded step of wrong types or values raises here
    environment, model = content.environment, content.engine.model
    summary["environment"] = {
        key: getattr(environment, key)
        for key in ("tracekit_version", "vllm_version", "torch_version", "python_version", "platform",
                    "device_kind", "device_name", "cpu_isa", "gpu_capability")
    }
    summary["numerics"] = numerics_summary(environment)
    summary["model"] = {"path": model.path, "architecture": model.architecture, "runner": content.engine.runner}
    draft = content.engine.draft_model
    if draft is not None:
        summary["draft_model"] = {"path": draft.path, "architecture": draft.architecture}
    if full:
        summary["content"] = _tensor_summaries(metadata, {info.name: info for info in reader.tensor_infos()})
    summary["created_at"] = content.created_at
    summary["derivations"] = content.derivations
    summary["redacted"] = any(entry.get("kind") == "redact" for entry in content.derivations)
    if content.parallel.multi_rank:
        summary["rank_set"] = {"this_rank": content.parallel.rank, **find_rank_set(reader.path).to_plain()}
    summary["steps"] = [
        {
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
            "kv": {
                "mode": step.kv.mode,
                "blocks_read": sum(len(group.read_block_ids) for group in step.kv.groups),
                "blocks_written": sum(len(group.written_block_ids) for group in step.kv.groups),
                "blocks_saved": sum(len(group.saved_block_ids) for group in step.kv.groups),
            },
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
        for step in content.steps
    ]
    return summary


def _spec_decode_summary(step) -> dict | None:
    """Speculative decoding in the step: the method, drafts verified and accepted (the sampled ids
    of a drafted request are its accepted drafts and one token more), the drafter's model calls."""
    record = step.spec_decode
    if record is None:
        return None
    sampled = step.outputs.sampled_token_ids if step.outputs is not None else None
    drafted = [(row, request) for row, request in enumerate(step.requests) if request.draft_token_ids]
    accepted = None
    if sampled is not None and all(row < len(sampled) for row, _ in drafted):
        accepted = sum(max(len(sampled[row]) - 1, 0) for row, _ in drafted)
    return {"method": record.method, "num_speculative_tokens": record.num_speculative_tokens,
            "drafts": sum(len(request.draft_token_ids) for _, request in drafted), "accepted": accepted,
            "drafter_calls": len(record.drafter_calls), "proposals": record.proposals is not None}


def _window_summary(step) -> dict | None:
    """The steps a step's window holds after it (`record --window`), each in a line's worth."""
    window = step.window
    if window is None:
        return None
    calls = [(call["call"], call["step"]) for call in window.calls]
    overlap = any(("execute", index + 1) in calls and ("output", index) in calls
                  and calls.index(("output", index)) > calls.index(("execute", index + 1))
                  for index in step.window_indices)
    return {
        "steps": step.window_indices,
        "requested": window.requested,
        "held_requests": [request.req_id for request in window.held_requests],
        "outputs_read_after_the_next_step": overlap,
        "later": [
            {"index": carried.index, "requests": len(carried.batch_order),
             "tokens": carried.graph.num_tokens if carried.graph is not None else None,
             "runtime_mode": carried.graph.runtime_mode if carried.graph is not None else None,
             "num_tokens_padded": carried.graph.num_tokens_padded if carried.graph is not None else None,
             "forward_us": carried.timing.forward_us,
             "error": carried.error.get("type") if carried.error is not None else None}
            for carried in window.steps
        ],
    }


def derivation_lines(derivations: list[dict]) -> list[str]:
    """One line per thing done to the recorded bundle (`tracekit shrink`, `tracekit redact`)."""
    lines = []
    for entry in derivations:
        if entry.get("kind") == "shrink":
            source = entry.get("from") if isinstance(entry.get("from"), dict) else {}
            steps = ""
            if isinstance(entry.get("steps_before"), list) and isinstance(entry.get("steps_after"), list):
                before, after = entry["steps_before"] or ["?"], entry["steps_after"] or ["?"]
                replayed = " (the first step's KV from a replay of the steps dropped)" if entry.get("first_step_kv") == "replayed" else ""
                steps = f"window steps {before[0]}..{before[-1]} -> {after[0]}..{after[-1]}{replayed}, "
            outputs = ("float outputs dropped where requests were cut" if "steps_after" in entry
                       else "no recorded outputs")
            lines.append(
                f"SHRUNK from {source.get('file')} (sha256 {str(source.get('sha256'))[:12]}...) until "
                f"{entry.get('property')}: {steps}requests {entry.get('requests_before')} -> {entry.get('requests_after')}, "
                f"tokens {entry.get('tokens_before')} -> {entry.get('tokens_after')}, {entry.get('replays')} replays; "
                f"{outputs}"
            )
        elif entry.get("kind") == "redact":
            lines.append(f"REDACTED (neutral token id {entry.get('neutral_token_id')}); removed:")
            lines.extend(f"  - {item}" for item in _listed(entry.get("removed")))
            for step in _listed(entry.get("steps")):
                kept = step.get("history_kept") if isinstance(step, dict) else None
                for req_id, readers in (kept.items() if isinstance(kept, dict) else ()):
                    lines.append(f"  kept every token id of {req_id}: its sampling or the drafter reads them ({', '.join(map(str, _listed(readers)))})")
            if _listed(entry.get("env_vars_removed")):
                lines.append(f"  environment variables removed: {', '.join(map(str, entry['env_vars_removed']))}")
        else:
            lines.append(f"derived: {entry.get('kind')}")
    return lines


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def _print_table(summary: dict, verify_report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(
        f"[bold]{inert(os.path.basename(summary['path']))}[/]: tracekit bundle format {inert(summary['format_version'])} "
        f"(needs reader >= {inert(summary['min_reader_version'])}), {_size(summary['file_bytes'])}, "
        f"written by {inert(summary['writer'])}"
    )
    if "environment" in summary:
        environment = {key: inert(value) for key, value in summary["environment"].items()}
        console.print(
            f"tracekit {environment['tracekit_version']} | vLLM {environment['vllm_version']} | "
            f"torch {environment['torch_version']} | {environment['device_kind']}: {environment['device_name']} | "
            f"{environment['platform']}"
        )
        numerics = summary["numerics"]
        facts = [f"{name} {numerics[name]}" for name in ("cpu_isa", "attention_backend", "num_threads", "gpu_capability")
                 if numerics.get(name) is not None]
        facts += [f"{name}={value}" for name, value in numerics["env_vars"].items()]
        console.print(inert(
            f"numerics: {numerics['device_kind']} {numerics['device_name']} | " + " | ".join(map(str, facts))
        ))
        console.print(
            f"model: {inert(summary['model']['path'])} ({inert(summary['model']['architecture'])}), "
            f"recorded on vLLM's {inert(str(summary['model']['runner']).upper())} model runner"
        )
        if "draft_model" in summary:
            console.print(f"draft model (speculative decoding): {inert(summary['draft_model']['path'])} "
                          f"({inert(summary['draft_model']['architecture'])})")
        for line in derivation_lines(summary["derivations"]):
            console.print(inert(line))
        if "rank_set" in summary:
            _print_rank_set(console, summary["rank_set"])
        console.print(f"steps: {len(summary['steps'])}")
        for step in summary["steps"][:MAX_TABLE_ROWS]:
            table = Table(title=f"step {inert(step['index'])} (trigger: {inert(step['trigger'])})", title_justify="left")
            for column in ("request", "scheduled", "computed", "prompt", "output", "drafts", "phase"):
                table.add_column(column, justify="left" if column in ("request", "phase") else "right")
            for request in step["requests"][:MAX_TABLE_ROWS]:
                table.add_row(*(inert(request[key]) for key in (
                    "req_id", "num_scheduled_tokens", "num_computed_tokens", "num_prompt_tokens", "num_output_tokens",
                    "num_draft_tokens", "phase")))
            console.print(table)
            _print_omitted(console, "requests", len(step["requests"]))
            dispatch = {key: inert(value) for key, value in step["dispatch"].items()}
            kv, timing = {key: inert(value) for key, value in step["kv"].items()}, step["timing_us"]
            console.print(
                f"  dispatch: {dispatch['num_tokens']} tokens -> {dispatch['num_tokens_padded']} padded, "
                f"graph {dispatch['runtime_mode']} (engine: compilation {dispatch['compilation_mode']}, "
                f"cudagraph {dispatch['cudagraph_mode']}, capture sizes {inert(step['dispatch']['capture_sizes'] or 'none')})"
            )
            console.print(
                f"  kv: {kv['blocks_read']} blocks read, {kv['blocks_written']} written, "
                f"{kv['blocks_saved']} saved (mode {kv['mode']})"
            )
            if step["spec_decode"] is not None:
                spec = {key: inert(value) for key, value in step["spec_decode"].items()}
                accepted = "" if step["spec_decode"]["accepted"] is None else f", {spec['accepted']} accepted"
                console.print(
                    f"  speculative decoding ({spec['method']}, {spec['num_speculative_tokens']} drafts a step): "
                    f"{spec['drafts']} drafts verified{accepted}; drafter model calls recorded: {spec['drafter_calls']}"
                    + ("" if step["spec_decode"]["proposals"] else "; its proposals were not recorded")
                )
            if timing["forward"] is not None and timing["step"] is not None:
                console.print(f"  forward {timing['forward'] / 1000:.3f} ms, step {timing['step'] / 1000:.3f} ms in the engine")
            if step["outputs_finite"] is False:
                console.print("  [red]outputs are not finite[/]")
            if step["grammar"]:
                console.print(f"  grammar mask: {step['grammar']['rows']} row(s) for structured-output request(s) "
                              f"{inert(', '.join(map(str, step['grammar']['requests'])))}")
            for adapter in step["lora_adapters"][:MAX_TABLE_ROWS]:
                kept = "kept in the bundle" if adapter["kept"] else "not kept (found by fingerprint when replayed)"
                console.print(f"  LoRA slot {inert(adapter['slot'])}: {inert(adapter['name'])}, rank {inert(adapter['rank'])}, "
                              f"{inert(adapter['fingerprint'])}, {kept}")
            if step["cannot_replay_yet"]:
                console.print(f"  [yellow]cannot be replayed yet: {inert(step['cannot_replay_yet'])}[/]")
            if step["error"]:
                error = step["error"]
                console.print(
                    f"  [red]the step raised {inert(error['type'])} in its "
                    f"{inert(error['phase'] or 'forward')} phase: {inert(error['message'])}[/]"
                )
            if step["window"]:
                _print_window(console, step["window"])
        _print_omitted(console, "steps", len(summary["steps"]))
    else:
        console.print(inert(summary["content"]))
    tensors = Table(title=f"tensors: {len(summary['tensors'])}", title_justify="left")
    for column in ("name", "dtype", "shape", "bytes", "stored", "filter"):
        tensors.add_column(column, justify="right" if column in ("bytes", "stored") else "left")
    for tensor in summary["tensors"][:MAX_TABLE_ROWS]:
        tensors.add_row(inert(tensor["name"]), tensor["dtype"], "x".join(map(str, tensor["shape"])) or "scalar",
                        _size(tensor["nbytes"]), _size(tensor["stored_nbytes"]), tensor["filter"])
    console.print(tensors)
    _print_omitted(console, "tensors", len(summary["tensors"]))
    if verify_report is not None:
        console.print(f"verify: all {len(verify_report.parts_checked)} parts intact" if verify_report.ok
                      else f"verify: {len(verify_report.damaged)} damaged part(s)")


def _print_window(console, window: dict) -> None:
    steps = window["steps"]
    held = f", {len(window['held_requests'])} request(s) held outside the first batch" if window["held_requests"] else ""
    order = ("the engine read each step's output after the next step ran (async scheduling)"
             if window["outputs_read_after_the_next_step"] else "the engine read each step's output before the next")
    console.print(f"  window: steps {steps[0]}..{steps[-1]} ({len(steps)} of {window['requested']} asked for){held}; "
                  f"{order}")
    for later in window["later"][:MAX_TABLE_ROWS]:
        forward = f", forward {later['forward_us'] / 1000:.3f} ms" if later["forward_us"] is not None else ""
        error = f", [red]raised {inert(later['error'])}[/]" if later["error"] else ""
        console.print(f"    step {later['index']}: {later['requests']} request(s), {inert(later['tokens'])} tokens -> "
                      f"{inert(later['num_tokens_padded'])} padded, graph {inert(later['runtime_mode'])}{forward}{error}")
    _print_omitted(console, "steps of the window", len(window["later"]))


def _print_rank_set(console, rank_set: dict) -> None:
    layout = f"TP={rank_set['tensor_parallel_size']}, PP={rank_set['pipeline_parallel_size']}"
    console.print(
        f"rank {rank_set['this_rank']} of {rank_set['world_size']} ({layout}) of step {inert(rank_set['step'])}, "
        f"session {inert(rank_set['set_id'])}"
    )
    for rank, path in rank_set["parts"].items():
        this = " (this bundle)" if int(rank) == rank_set["this_rank"] else ""
        console.print(f"  rank {rank}: {inert(path)}{this}")
    for rank in rank_set["missing"]:
        console.print(f"  [red]rank {rank}: missing[/]")
    for problem in rank_set["problems"]:
        console.print(f"  [red]{inert(problem)}[/]")
    console.print("  set complete" if rank_set["complete"] else "  [red]set incomplete: cannot be replayed[/]")


def _print_omitted(console, what: str, count: int) -> None:
    if count > MAX_TABLE_ROWS:
        console.print(f"  ... and {count - MAX_TABLE_ROWS} more {what} (--json lists all)")


@click.command("inspect")
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--verify", is_flag=True, help="Decode every part and check every hash (reads the whole file).")
@click.option("--full", is_flag=True, help="With --json: also the whole recorded content (scheduler output, "
                                           "request states), tensors as name/dtype/shape.")
def inspect_command(bundle, as_json, verify, full):
    """Summarize a bundle: versions, environment, model, steps, requests and tensors."""
    if full and not as_json:
        raise UsageError("--full dumps the recorded content as JSON: use it with --json")
    with open_bundle(bundle) as reader:
        summary = _summary(reader, full)
        report = reader.verify() if verify else None
    if report is not None:
        summary["verify"] = {"ok": report.ok, "parts_checked": len(report.parts_checked), "damaged": report.damaged}
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
    else:
        _print_table(summary, report)
    if report is not None and not report.ok:
        part, problem = next(iter(report.damaged.items()))
        more = f" (and {len(report.damaged) - 1} more damaged part(s))" if len(report.damaged) > 1 else ""
        raise BundleError(f"bundle {os.path.basename(bundle)} is damaged: {part} {problem}{more}")
