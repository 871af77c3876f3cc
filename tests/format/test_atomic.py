"""Writing is atomic: an aborted, failed or killed writer leaves nothing readable at the path."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from tracekit.errors import BundleError
from tracekit.format import BundleWriter, open_bundle


def test_exception_inside_the_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with BundleWriter(tmp_path / "b.zst") as writer:
            writer.add_tensor("x", torch.zeros(1000))
            raise RuntimeError("recorder failed")
    assert os.listdir(tmp_path) == []


def test_abort_leaves_nothing(tmp_path):
    writer = BundleWriter(tmp_path / "b.zst")
    writer.add_tensor("x", torch.zeros(10))
    writer.abort()
    writer.close()  # a no-op after abort
    assert os.listdir(tmp_path) == []
    with pytest.raises(BundleError, match="already closed"):
        writer.add_tensor("y", torch.zeros(1))


KILLED_WRITER = """
import sys, torch
from tracekit.format import BundleWriter
writer = BundleWriter(sys.argv[1], chunk_bytes=1 << 20)
for number in range(10_000):
    writer.add_tensor(f"t{number}", torch.randn(1 << 18))
    if number == 7:  # a few chunks queued beyond those in flight: several are on disk
        print("writing", flush=True)
"""


def test_writer_killed_mid_write_leaves_no_valid_bundle(tmp_path, small_bundle):
    target = tmp_path / "killed.zst"
    target.write_bytes(small_bundle.read_bytes())  # an earlier bundle at the path stays intact
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    assert target.read_bytes() == small_bundle.read_bytes()
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith("killed.zst.tmp-")]
    assert len(leftovers) == 1 and os.path.getsize(tmp_path / leftovers[0]) > 1 << 20
    with pytest.raises(BundleError, match="is damaged: trailer"):
        open_bundle(tmp_path / leftovers[0])
