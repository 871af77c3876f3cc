"""Writing is atomic: an aborted, failed or killed writer leaves nothing readable at the path,
and the next writer in the folder deletes what a killed one left behind."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tracekit.errors import BundleError
from tracekit.format import BundleWriter, open_bundle
from tracekit.format.layout import PARTIAL_SUFFIX
from tracekit.format.leftovers import STALE_AFTER_SECONDS, remove_stale_partials, temporary_path


def partials(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(PARTIAL_SUFFIX))


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


# Writes numpy tensors (no torch import: the process starts fast) until killed. With a
# "replace" argument it kills itself at the last step of the commit: file complete and
# synced, not yet renamed, the worst moment for a leftover.
KILLED_WRITER = """
import os, signal, sys
import numpy as np
from tracekit.format import BundleWriter
if sys.argv[2] == "replace":
    os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
writer = BundleWriter(sys.argv[1], chunk_bytes=1 << 20)
print("started", flush=True)
values = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
for number in range(int(sys.argv[3])):
    writer.add_tensor(f"t{number}", values)
writer.set_metadata({"tensors": int(sys.argv[3])})
writer.close()
"""


def run_killed_writer(target, mode: str, tensors: int, delay: float) -> None:
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target), mode, str(tensors)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "started\n"
        if mode == "random":
            time.sleep(delay)
    finally:
        if mode == "random":
            writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    assert writer.returncode in (-signal.SIGKILL, 0)


def test_writers_killed_at_random_points_leave_no_bundle_and_no_litter(tmp_path, small_bundle):
    target = tmp_path / "killed.zst"
    earlier = small_bundle.read_bytes()
    target.write_bytes(earlier)  # an earlier bundle at the path stays intact until a commit
    rng = random.Random(11)
    runs = [("random", 40, rng.uniform(0, 0.6)) for _ in range(6)] + [("replace", 3, 0.0)] * 2
    for mode, tensors, delay in runs:
        run_killed_writer(target, mode, tensors, delay)
        if target.read_bytes() != earlier:  # the writer got to commit: a whole new bundle
            with open_bundle(target) as reader:
                assert reader.verify().ok and reader.metadata == {"tensors": 40}
            earlier = target.read_bytes()
        left = partials(tmp_path)
        assert len(left) <= 1, left  # the killed writer's own partial; earlier ones were cleaned
        for name in left:
            with pytest.raises(BundleError, match="is an unfinished bundle"):
                open_bundle(tmp_path / name)
            renamed = tmp_path / "renamed.zst"
            renamed.write_bytes((tmp_path / name).read_bytes())
            try:  # cut short of its commit, the trailer says so whatever the name; after it, it is whole
                with open_bundle(renamed) as reader:
                    assert reader.verify().ok and reader.metadata == {"tensors": tensors}
            except BundleError as error:
                assert "is damaged" in str(error) or "is not a tracekit bundle" in str(error)
            renamed.unlink()
    assert len(partials(tmp_path)) == 1  # the last run (killed before its rename) left one
    with BundleWriter(target) as writer:  # the next writer in the folder removes it
        writer.add_tensor("x", np.arange(3))
    assert partials(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["killed.zst", "small.zst"]


def test_only_dead_or_old_writers_partials_are_removed(tmp_path):
    mine = temporary_path(str(tmp_path / "a.zst"))  # this process is alive
    open(mine, "wb").close()
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    dead = mine.replace(f"-{os.getpid()}-", f"-{dead_pid}-")
    open(dead, "wb").close()
    other_host = os.path.join(tmp_path, ".b.zst.otherhost-1-0123abcd" + PARTIAL_SUFFIX)
    old_other_host = os.path.join(tmp_path, ".c.zst.otherhost-1-0123abcd" + PARTIAL_SUFFIX)
    unrelated = os.path.join(tmp_path, "notes" + PARTIAL_SUFFIX)
    for path in (other_host, old_other_host, unrelated):
        open(path, "wb").close()
    old = time.time() - STALE_AFTER_SECONDS - 60
    os.utime(old_other_host, (old, old))
    assert sorted(remove_stale_partials(str(tmp_path))) == sorted(map(os.path.basename, [dead, old_other_host]))
    assert sorted(os.listdir(tmp_path)) == sorted(map(os.path.basename, [mine, other_host, unrelated]))


def test_a_failed_background_writeback_fails_the_write_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import tracekit.format.writeback as writeback

    def failing_sync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(writeback, "DEFAULT_EVERY_BYTES", 1 << 16)  # a sync per 64 KiB written
    monkeypatch.setattr(writeback, "_sync", failing_sync)  # a disk that fails, as no test disk does
    writer = BundleWriter(tmp_path / "b.zst")
    writer.add_tensor("x", torch.randn(1 << 18))  # 1 MiB
    with pytest.raises(BundleError, match="cannot write bundle .*b.zst: Input/output error"):
        writer.close()
    assert os.listdir(tmp_path) == []


def test_writeback_syncs_while_writing(tmp_path, monkeypatch):
    import tracekit.format.writeback as writeback

    synced = []
    real_sync = writeback._sync
    monkeypatch.setattr(writeback, "DEFAULT_EVERY_BYTES", 1 << 16)
    monkeypatch.setattr(writeback, "_sync", lambda fd: synced.append(fd) or real_sync(fd))
    with BundleWriter(tmp_path / "b.zst") as writer:
        for number in range(8):
            writer.add_tensor(f"x{number}", torch.randn(1 << 16))  # 256 KiB each, barely compressible
            writer._writeback.finish()  # let each sync end, so the next batch of bytes starts one
    assert len(synced) >= 4
    with open_bundle(tmp_path / "b.zst") as reader:
        assert reader.verify().ok
