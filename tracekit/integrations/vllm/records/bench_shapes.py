"""Recorded batches as cases for `vllm bench forward --shapes FILE` (vLLM 0.33 and later), so
the exact production batches can be benchmarked without shipping the bundles (docs/GUIDE.md,
"Exporting the recorded batches to `vllm bench forward`", says what a case holds).
`vllm/benchmarks/forward/shapes.py`, `load_cases`, is the reader and the specification. Only
metadata is read: no tensor, no vLLM.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit import __version__
from tracekit.bundles import unique_names
from tracekit.errors import UsageError
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, RequestState, Step

# Engine arguments that shape the batches; repeated in the file as a starting command line.
SHAPE_ARGS = ("dtype", "max_model_len", "block_size", "kv_cache_dtype")
YAML_SUFFIXES = (".yaml", ".yml")  # as vLLM's `load_cases` decides between YAML and JSON


@dataclass
class ShapeCase:
    name: str
    requests: list[dict[str, Any]]  # run-length encoded: consecutive equal requests share a `count`
    source: str  # the comment line saying where the case comes from


def bench_request(request: RequestState, draft_tokens: int, continuing: bool) -> dict[str, Any]:
    """One request in `BenchRequest` terms; fields at their default are left out. A prefill with a
    prefix is `chunked` when the prefix came from its own earlier chunks (`continuing`: the runner
    knew the request already), otherwise a prefix-cache hit, as the bench tells them apart."""
    query_len = request.num_scheduled_tokens
    kv_len = request.num_computed_tokens + query_len
    prefix_len = kv_len - query_len
    entry: dict[str, Any] = {"query_len": query_len, "kv_len": kv_len}
    is_decode = prefix_len > 0 and query_len == 1 + draft_tokens  # vLLM's `BenchRequest.is_decode`
    if draft_tokens and is_decode:
        entry["num_draft_tokens"] = draft_tokens
    if prefix_len > 0 and not is_decode and continuing:
        entry["chunked"] = True
    return entry


def step_requests(step: Step) -> list[dict[str, Any]]:
    """The step's scheduled requests in batch order, run-length encoded."""
    scheduler = step.scheduler_output
    new_ids = {entry.req_id for entry in scheduler.scheduled_new_reqs}
    resumed = scheduler.scheduled_cached_reqs.resumed_req_ids
    drafts = scheduler.scheduled_spec_decode_tokens
    position = {req_id: i for i, req_id in enumerate(step.batch_order)}
    encoded: list[dict[str, Any]] = []
    for request in sorted(step.requests, key=lambda r: position.get(r.req_id, len(position))):
        if request.num_scheduled_tokens == 0:
            continue
        continuing = request.req_id not in new_ids and request.req_id not in resumed
        entry = bench_request(request, len(drafts.get(request.req_id, ())), continuing)
        if encoded and {k: v for k, v in encoded[-1].items() if k != "count"} == entry:
            encoded[-1]["count"] = encoded[-1].get("count", 1) + 1
        else:
            encoded.append(entry)
    return encoded


def shape_cases(bundles: Sequence[Path]) -> tuple[list[ShapeCase], list[str]]:
    """Cases for every recorded step of `bundles`, and a starting command line per engine."""
    cases, engines = [], []
    for bundle, name in zip(bundles, unique_names(bundles)):
        with open_bundle(bundle) as reader:
            content = BundleContent.from_plain(reader.metadata)
        args = content.engine.engine_args
        engine = " ".join(
            [f"--model {content.engine.model.path}"]
            + [f"--{key.replace('_', '-')} {args[key]}" for key in SHAPE_ARGS if args.get(key) is not None]
        )
        if engine not in engines:
            engines.append(engine)
        for step in content.steps:
            requests = step_requests(step)
            if not requests:
                continue
            recorded = step.timing.forward_us
            cases.append(ShapeCase(
                name=name if len(content.steps) == 1 else f"{name}.step{step.index}",
                requests=requests,
                source=(f"{bundle} step {step.index}: {sum(r.get('count', 1) for r in requests)} request(s), "
                        f"{step.graph.num_tokens} token(s)"
                        + (f", recorded forward {recorded / 1000:.3f} ms" if isinstance(recorded, (int, float)) else "")
                        + f" on {content.environment.device_kind} {content.environment.device_name or ''}".rstrip()),
            ))
    if not cases:
        raise UsageError("none of the bundles holds a step with scheduled requests")
    return cases, engines


def render_yaml(cases: Sequence[ShapeCase], engines: Sequence[str]) -> str:
    lines = [
        f"# `vllm bench forward --shapes` cases: recorded engine steps exported by tracekit {__version__}.",
        "# Keep the recorded KV lengths with --kv-len-jitter 0 (the bench draws them +-50% by default).",
        *(f"# recorded with: {_comment(engine)}" for engine in engines),
        "cases:",
    ]
    for case in cases:
        lines += [f"  # {_comment(case.source)}", f"  - name: {json.dumps(case.name)}", "    requests:"]
        lines += ["      - {" + ", ".join(f"{key}: {json.dumps(value)}" for key, value in entry.items()) + "}"
                  for entry in case.requests]
    return "\n".join(lines) + "\n"


def render_json(cases: Sequence[ShapeCase], engines: Sequence[str]) -> str:
    data = {
        "cases": [{"name": case.name, "requests": case.requests} for case in cases],
        "tracekit": {"version": __version__, "recorded_with": list(engines),
                     "sources": {case.name: case.source for case in cases}},
    }
    return json.dumps(data, indent=1) + "\n"


def render(cases: Sequence[ShapeCase], engines: Sequence[str], output: str) -> str:
    """YAML for a .yaml/.yml (or `-`) output, JSON otherwise — as vLLM reads them."""
    yaml = output == "-" or output.endswith(YAML_SUFFIXES)
    return render_yaml(cases, engines) if yaml else render_json(cases, engines)


def _comment(text: str) -> str:
    """Text from a bundle as one line of a YAML comment: whitespace runs as one space, and what a
    YAML file may not hold or a terminal would act on (control and format characters, bidi
    overrides) as `\\uXXXX`."""
    return "".join(char if char.isprintable() else f"\\u{ord(char):04x}" for char in " ".join(str(text).split()))
