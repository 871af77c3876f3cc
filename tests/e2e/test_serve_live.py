"""Live control of a real `vllm serve` (API server, engine core and worker in their own
processes), through the routes tracekit's endpoint plugin adds and `tracekit arm|status|disarm`,
run as the README's serving section says (its every command, in order: install into the server's
environment, start, arm on the id a request's response carries, status, disarm, replay a copy of
the folder): off without the API key, every bad setting refused before anything is armed while
the server goes on serving, a request targeted by the X-Request-Id its client sent and another by
its response's id, a recorder replaced by another without a restart, the server's log saying what
tracekit did, and the bundles replayed bit-exact. One server for every check."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_support import engine_env, read_step
from serve_support import TINY_SERVER_ARGS, install_tracekit, readme_commands, vllm_serve

from tracekit.models import tiny_model_path

pytestmark = pytest.mark.slow
KEY = "live-control-test-key"
BODY = {"model": tiny_model_path(), "prompt": "Hello there, engine", "temperature": 0, "ignore_eos": True}
# What the README's commands name, and what they are in this test
README_SERVER, README_REQUEST, README_FOLDER = "http://127.0.0.1:8000", "cmpl-99a6ae51716401f0", "/data/tracekit"


class Readme:
    """The README's serving commands, run here with the README's names replaced by this test's."""

    def __init__(self) -> None:
        self.pip, self.serve, self.arm, self.status, self.disarm, self.replay = readme_commands("## In a running vllm serve")
        self.names: dict[str, str] = {}

    def __call__(self, command: list[str]) -> list[str]:
        replaced = []
        for arg in command:
            for name, value in self.names.items():
                arg = arg.replace(name, value)
            replaced.append(arg)
        return replaced

    def server_env(self) -> dict[str, str]:
        """The variables the README's server line sets, before `vllm serve MODEL`."""
        *assignments, vllm, serve, model = self(self.serve)
        assert (vllm, serve, model) == ("vllm", "serve", "MODEL")
        return dict(assignment.split("=", 1) for assignment in assignments)


def _tracekit(installed: Path, *args: str, key: str | None = KEY, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    env.pop("VLLM_API_KEY", None)
    if key:
        env["VLLM_API_KEY"] = key
    return subprocess.run([str(installed / "bin" / "tracekit"), *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=cwd or installed)


def _ran(finished: subprocess.CompletedProcess) -> str:
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return finished.stdout


def _refused(finished: subprocess.CompletedProcess, reason: str) -> None:
    assert finished.returncode == 2, finished.stdout + finished.stderr
    assert re.search(reason, finished.stderr), finished.stderr
    assert len(finished.stderr.strip().splitlines()) == 1, finished.stderr


def _bundles(folder: Path, count: int) -> list[Path]:
    deadline = time.monotonic() + 60
    while len(found := sorted(folder.glob("*.zst"))) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def test_live_control_of_a_running_server(tmp_path):
    readme = Readme()
    served, outside = tmp_path / "served", tmp_path / "outside"
    readme.names[README_FOLDER] = str(served)
    installed = install_tracekit(readme.pip, "./tracekit", tmp_path / "site")
    served.mkdir(), outside.mkdir()
    (served / "escape").symlink_to(outside)
    (served / "used").mkdir()
    (served / "used" / "step0.zst").write_bytes(b"an earlier bundle")
    env = {**engine_env("v1"), "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONPATH": str(installed),
           **readme.server_env()}
    with vllm_serve(env, tmp_path / "serve.log", TINY_SERVER_ARGS, key=KEY) as server:
        readme.names[README_SERVER] = server.url
        arm = ("arm", "--server", server.url)
        # vLLM's API key guards the routes
        _refused(_tracekit(installed, *readme(readme.status)[1:], key=None), "wants its API key")
        # every bad setting is refused, in one line, before anything is armed; the server serves on
        _refused(_tracekit(installed, *arm, "--when", "generated<3"), "bad --when .* add one")
        _refused(_tracekit(installed, *arm, "--steps", "1", "-o", "../elsewhere"), "bad -o '../elsewhere'")
        _refused(_tracekit(installed, *arm, "--steps", "1", "-o", str(outside)), "no absolute path")
        _refused(_tracekit(installed, *arm, "--steps", "1", "-o", "escape/x"), "outside the server's bundle folder")
        _refused(_tracekit(installed, *arm, "--steps", "1", "-o", "used"), "already exists and is not an empty")
        assert "not armed" in _ran(_tracekit(installed, *readme(readme.status)[1:]))
        assert server.post("/v1/completions", {**BODY, "max_tokens": 2})["usage"]["completion_tokens"] == 2

        # a request's first prefill chunk, by the X-Request-Id its client sends; a request whose id
        # merely starts the same way is not it
        _ran(_tracekit(installed, *arm, "--when", "request==probe-1 and first_chunk", "-o", "probe", "--max-bundles", "1"))
        decoy = server.post("/v1/completions", {**BODY, "max_tokens": 2}, **{"X-Request-Id": "probe-1-0"})
        probe = server.post("/v1/completions", {**BODY, "max_tokens": 2}, **{"X-Request-Id": "probe-1"})
        assert (decoy["id"], probe["id"]) == ("cmpl-probe-1-0", "cmpl-probe-1")
        (first_chunk,) = _bundles(served / "probe", 1)

        # always on, then re-armed without a restart (the README's command) on the id the response
        # of a request carries, before the request comes: it takes the request's steps, up to its cap
        _ran(_tracekit(installed, *arm, "--on", "exception,nonfinite", "-o", "always"))
        readme.names[README_REQUEST] = "cmpl-incident-42"
        _ran(_tracekit(installed, *readme(readme.arm)[1:]))
        reported = server.post("/v1/completions", {**BODY, "max_tokens": 40}, **{"X-Request-Id": "incident-42"})
        assert reported["id"] == readme.names[README_REQUEST]
        incident = served / readme(readme.arm)[-1]
        steps = _bundles(incident, 16)
        status = _ran(_tracekit(installed, *readme(readme.status)[1:]))

        # armed and disarmed (the README's command); the engine then runs as without tracekit
        _ran(_tracekit(installed, *arm, "--on", "nonfinite", "-o", "last"))
        assert "disarmed by POST /v1/tracekit/disarm" in _ran(_tracekit(installed, *readme(readme.disarm)[1:]))
        assert server.post("/v1/completions", {**BODY, "max_tokens": 2})["usage"]["completion_tokens"] == 2
        log = server.log_before_shutdown()

    step = read_step(first_chunk)
    assert [request.req_id[: -len("-0-12345678")] for request in step.requests] == ["cmpl-probe-1"]
    assert step.requests[0].is_prefill and step.trigger == "when request==probe-1 and first_chunk"
    assert len(steps) == 16 and "16 of at most 16 bundles written" in status, status
    for path in steps:
        ids = [request.req_id for request in read_step(path).requests]
        assert any(re.fullmatch(re.escape(reported["id"]) + r"-0-[0-9a-f]{8}", req_id) for req_id in ids), ids
    assert not any(outside.iterdir()) and (served / "used" / "step0.zst").read_bytes() == b"an earlier bundle"
    assert sorted(path.name for path in served.iterdir()) == sorted(
        ["always", "escape", "last", "probe", incident.name, "used"])

    # the server's own log: one banner per arming, a line per bundle, why each recorder stopped
    assert log.count("tracekit: ARMED by POST /v1/tracekit/arm") == 4, log[-4000:]
    for path in (first_chunk, *steps):
        assert re.search(rf"tracekit: wrote {re.escape(str(path))} \(\d+ KiB\): step \d+ \(when request==", log)
    assert "the recorder took 1 bundle, the most it takes (max_bundles 1); it stopped recording" in log
    assert "the recorder took 16 bundles, the most it takes (max_bundles 16)" in log
    assert "the recorder armed by POST /v1/tracekit/arm is replaced by one armed by POST /v1/tracekit/arm" in log
    assert "tracekit: disarmed by POST /v1/tracekit/disarm" in log
    assert "Traceback" not in log

    # the folder copied to another machine (here: another folder) and replayed there, with the
    # first-chunk bundle beside it, in a fresh process: every bundle bit-exact
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(incident, elsewhere / incident.name)
    shutil.copy(first_chunk, elsewhere / incident.name / "first-chunk.zst")
    replay = readme(readme.replay)
    assert replay[:2] == ["tracekit", "replay"]
    replayed = subprocess.run([str(Path(sys.executable).with_name("tracekit")), *replay[1:], "--strict"],
                              env=engine_env("v1"), capture_output=True, text=True, timeout=400, cwd=elsewhere)
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-2000:]
