"""The vLLM plugin records inside a real `vllm serve` (OpenAI server, engine core and worker in
their own processes) when armed by environment variables, on both model runners: the steps of the
request a client names by its X-Request-Id, up to its first decode; what it records replays; the
server's log says so; and when a later bundle cannot be written the server goes on answering as
before."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_support import RUNNER_KINDS, engine_env
from serve_support import TINY_SERVER_ARGS, vllm_serve

from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent
from tracekit.models import tiny_model_path

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("runner", RUNNER_KINDS)
def test_plugin_records_inside_vllm_serve_and_a_failed_write_harms_nothing(runner, tmp_path):
    log = tmp_path / "serve.log"
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **engine_env(runner),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the server's own layout: engine core apart
        "TRACEKIT_RECORD_OUTPUT": str(out / "serve-step{step}.zst"),
        "TRACEKIT_RECORD_WHEN": "request==plugin-1 and generated<2",
    }
    body = {"model": tiny_model_path(), "prompt": "Hello there, engine", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    with vllm_serve(env, log, TINY_SERVER_ARGS) as server:
        # Steps 0-2: a prefill and two decodes; steps 0 and 1 are recorded.
        first = server.post("/v1/completions", body, **{"X-Request-Id": "plugin-1"})
        assert first["usage"]["completion_tokens"] == 3
        bundles = [out / f"serve-step{index}.zst" for index in (0, 1)]
        deadline = time.monotonic() + 30
        while not all(path.exists() for path in bundles) and time.monotonic() < deadline:
            time.sleep(0.5)
        kept = tmp_path / "kept"
        out.rename(kept)  # the next bundle now has nowhere to go
        bundles = [kept / path.name for path in bundles]
        unnamed = server.post("/v1/completions", body)  # not recorded: another request
        second = server.post("/v1/completions", body, **{"X-Request-Id": "plugin-1"})  # its prefill fails to write
        third = server.post("/v1/completions", body, **{"X-Request-Id": "plugin-1"})
        server.post("/v1/completions", {**body, "max_tokens": 1})  # still serving

    served = log.read_text()
    assert unnamed["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"] == third["choices"][0]["text"]
    assert served.count("tracekit: could not write") == 1, served[-3000:]
    assert "recording stops, the engine goes on unrecorded" in served
    # the server's own log says tracekit is there, and what it wrote
    assert served.count("tracekit: ARMED by TRACEKIT_RECORD_OUTPUT at start: recording when request==plugin-1") == 1
    assert served.count("tracekit: wrote ") == 2, served[-3000:]
    before_shutdown = served.split("[shutdown]", 1)[0]  # vLLM logs tracebacks of its own as SIGTERM kills it
    assert "Traceback" not in before_shutdown, before_shutdown[-3000:]
    assert not out.exists(), "nothing may recreate the removed output folder"
    assert sorted(path.name for path in kept.iterdir()) == [path.name for path in bundles]
    for index, path in enumerate(bundles):
        with open_bundle(path) as reader:
            assert reader.verify().ok
            content = BundleContent.from_plain(reader.metadata)
        step = content.steps[0]
        assert content.engine.runner == runner
        assert step.index == index and step.trigger == "when request==plugin-1 and generated<2"
        assert step.requests[0].is_prefill == (index == 0)
        assert content.engine.engine_args["model"] == tiny_model_path()

    replayed = subprocess.run(
        [str(Path(sys.executable).with_name("tracekit")), "replay", str(bundles[1])],
        env=engine_env(runner), capture_output=True, text=True, timeout=300,
    )
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
    assert "REPRODUCED (bit-exact)" in replayed.stdout
