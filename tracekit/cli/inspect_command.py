"""`tracekit inspect BUNDLE`: what a bundle holds (`tracekit.share.summary`), as a table or JSON.

A bundle damaged where `--verify` looked exits with code 2, after its summary. Tables stop after
`MAX_TABLE_ROWS` rows (`--json` lists everything); every string from the bundle is shown `inert`.
"""

import os

import click

from tracekit.cli.arguments import force_option, json_option, json_took_an_argument
from tracekit.cli.terminal import console_for, inert, table
from tracekit.errors import UsageError
from tracekit.share.summary import listed

MAX_TABLE_ROWS = 200


@click.command("inspect")
@click.argument("bundle", type=click.Path(dir_okay=False), required=False)
@json_option("the summary")
@click.option("--verify", is_flag=True, help="Decode every part and check every hash (reads the whole file).")
@click.option("--full", is_flag=True, help="With --json: also the whole recorded content (scheduler output, "
                                           "request states), tensors as name/dtype/shape.")
@force_option()
def inspect_command(bundle, json_out, verify, full, force):
    """Summarize a bundle: what it needs to replay, versions, environment, model, steps, requests
    and tensors."""
    from tracekit.outputs import claim_outputs, write_json
    from tracekit.share.summary import damage, summarize

    bundle = bundle or json_took_an_argument(json_out, "BUNDLE")
    if full and not json_out:
        raise UsageError("--full dumps the recorded content as JSON: use it with --json")
    claim_outputs({"--json": json_out}, [bundle], force)
    summary = summarize(bundle, full, verify)
    if json_out:
        write_json(summary, json_out, indent=2)
    else:
        _print_summary(summary)
    damaged = damage(summary)
    if damaged is not None:
        raise damaged


def _print_summary(summary: dict) -> None:
    console = console_for()
    console.print(
        f"[bold]{inert(os.path.basename(summary['path']))}[/]: tracekit bundle format {inert(summary['format_version'])} "
        f"(needs reader >= {inert(summary['min_reader_version'])}), {_size(summary['file_bytes'])}, "
        f"written by {inert(summary['writer'])}"
    )
    if "environment" in summary:
        _print_recording(console, summary)
    else:
        console.print(inert(summary["content"]))
    _print_tensors(console, summary["tensors"])
    if "verify" in summary:
        verified = summary["verify"]
        console.print(f"verify: all {verified['parts_checked']} parts intact" if verified["ok"]
                      else f"verify: {len(verified['damaged'])} damaged part(s)")


def _print_recording(console, summary: dict) -> None:
    """What the bundle needs, where and how it was recorded, what was done to it, its steps."""
    from tracekit.integrations.vllm.records.needs import BundleNeeds

    console.print(inert(BundleNeeds(**summary["needs"]).line()))
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
    console.print(inert(f"numerics: {numerics['device_kind']} {numerics['device_name']} | " + " | ".join(map(str, facts))))
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
        _print_step(console, step)
    _print_omitted(console, "steps", len(summary["steps"]))


def _print_step(console, step: dict) -> None:
    requests = table(console, f"step {inert(step['index'])} (trigger: {inert(step['trigger'])})",
                     ["request", "scheduled", "computed", "prompt", "output", "drafts", "phase"],
                     right=("scheduled", "computed", "prompt", "output", "drafts"))
    for request in step["requests"][:MAX_TABLE_ROWS]:
        requests.add_row(*(inert(request[key]) for key in (
            "req_id", "num_scheduled_tokens", "num_computed_tokens", "num_prompt_tokens", "num_output_tokens",
            "num_draft_tokens", "phase")))
    if step["requests"]:
        console.print(requests)
    _print_omitted(console, "requests", len(step["requests"]))
    dispatch = {key: inert(value) for key, value in step["dispatch"].items()}
    kv, timing = {key: inert(value) for key, value in step["kv"].items()}, step["timing_us"]
    console.print(
        f"  dispatch: {dispatch['num_tokens']} tokens -> {dispatch['num_tokens_padded']} padded, "
        f"graph {dispatch['runtime_mode']} (engine: compilation {dispatch['compilation_mode']}, "
        f"cudagraph {dispatch['cudagraph_mode']}, capture sizes {inert(step['dispatch']['capture_sizes'] or 'none')})"
    )
    console.print(f"  kv: {kv['blocks_read']} blocks read, {kv['blocks_written']} written, "
                  f"{kv['blocks_saved']} saved (mode {kv['mode']})")
    _print_spec_decode(console, step["spec_decode"])
    if timing["forward"] is not None and timing["step"] is not None:
        console.print(f"  forward {timing['forward'] / 1000:.3f} ms, step {timing['step'] / 1000:.3f} ms in the engine")
    _print_step_notes(console, step)
    if step["window"]:
        _print_window(console, step["window"])


def _print_spec_decode(console, spec_decode: dict | None) -> None:
    if spec_decode is None:
        return
    spec = {key: inert(value) for key, value in spec_decode.items()}
    accepted = "" if spec_decode["accepted"] is None else f", {spec['accepted']} accepted"
    console.print(
        f"  speculative decoding ({spec['method']}, {spec['num_speculative_tokens']} drafts a step): "
        f"{spec['drafts']} drafts verified{accepted}; drafter model calls recorded: {spec['drafter_calls']}"
        + ("" if spec_decode["proposals"] else "; its proposals were not recorded")
    )


def _print_step_notes(console, step: dict) -> None:
    """What else there is to know of the step: non-finite outputs, grammar, LoRA, what cannot be
    replayed yet, the error it raised."""
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
        console.print(f"  [red]the step raised {inert(error['type'])} in its {inert(error['phase'] or 'forward')} "
                      f"phase: {inert(error['message'])}[/]")


def _print_tensors(console, tensors: list[dict]) -> None:
    shown = table(console, f"tensors: {len(tensors)}", ["name", "dtype", "shape", "bytes", "stored", "filter"],
                  right=("bytes", "stored"))
    for tensor in tensors[:MAX_TABLE_ROWS]:
        shown.add_row(inert(tensor["name"]), tensor["dtype"], "x".join(map(str, tensor["shape"])) or "scalar",
                      _size(tensor["nbytes"]), _size(tensor["stored_nbytes"]), tensor["filter"])
    console.print(shown if tensors else "tensors: none")
    _print_omitted(console, "tensors", len(tensors))


def derivation_lines(derivations: list[dict]) -> list[str]:
    """One line per thing done to the recorded bundle (`tracekit shrink`, `tracekit redact`)."""
    lines = []
    for entry in derivations:
        if entry.get("kind") == "shrink":
            lines.append(_shrink_line(entry))
        elif entry.get("kind") == "redact":
            lines.extend(_redact_lines(entry))
        else:
            lines.append(f"derived: {entry.get('kind')}")
    return lines


def _shrink_line(entry: dict) -> str:
    source = entry.get("from") if isinstance(entry.get("from"), dict) else {}
    steps = ""
    if isinstance(entry.get("steps_before"), list) and isinstance(entry.get("steps_after"), list):
        before, after = entry["steps_before"] or ["?"], entry["steps_after"] or ["?"]
        replayed = " (the first step's KV from a replay of the steps dropped)" if entry.get("first_step_kv") == "replayed" else ""
        steps = f"window steps {before[0]}..{before[-1]} -> {after[0]}..{after[-1]}{replayed}, "
    outputs = "float outputs dropped where requests were cut" if "steps_after" in entry else "no recorded outputs"
    return (f"SHRUNK from {source.get('file')} (sha256 {str(source.get('sha256'))[:12]}...) until "
            f"{entry.get('property')}: {steps}requests {entry.get('requests_before')} -> {entry.get('requests_after')}, "
            f"tokens {entry.get('tokens_before')} -> {entry.get('tokens_after')}, {entry.get('replays')} replays; "
            f"{outputs}")


def _redact_lines(entry: dict) -> list[str]:
    lines = [f"REDACTED (neutral token id {entry.get('neutral_token_id')}); removed:"]
    lines.extend(f"  - {item}" for item in listed(entry.get("removed")))
    for step in listed(entry.get("steps")):
        kept = step.get("history_kept") if isinstance(step, dict) else None
        for req_id, readers in (kept.items() if isinstance(kept, dict) else ()):
            lines.append(f"  kept every token id of {req_id}: its sampling or the drafter reads them "
                         f"({', '.join(map(str, listed(readers)))})")
    if listed(entry.get("env_vars_removed")):
        lines.append(f"  environment variables removed: {', '.join(map(str, entry['env_vars_removed']))}")
    return lines


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


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
