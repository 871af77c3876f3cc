"""The recorder's writer thread (`tracekit.record.persist.BackgroundPersister`) on the sample
trace's step: a bundle whose copies can never land because a later step lost the device context
is left unwritten without stopping the writer (the failed step's bundle still comes), while any
other failure waiting for copies stops it and tells the recorder."""

from pathlib import Path

import pytest

from tracekit.format.content import load_step
from tracekit.record.persist import BackgroundPersister

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"


def _raising(message):
    def ready():
        raise RuntimeError(message)

    return ready


@pytest.fixture
def persister():
    content, step = load_step(SAMPLE, None)
    told = []
    writer = BackgroundPersister(content.environment, content.engine, on_failure=told.append)
    yield writer, step, told
    writer.close()


def test_a_lost_device_context_leaves_that_bundle_unwritten_and_the_writer_on(persister, tmp_path):
    writer, step, told = persister
    writer.submit(tmp_path / "lost.zst", step, ready=_raising("CUDA error: an illegal memory access was encountered"))
    writer.submit(tmp_path / "next.zst", step)
    writer.wait_idle()
    writer.submit(tmp_path / "failed.zst", step, now=True)
    assert writer.written == [tmp_path / "next.zst", tmp_path / "failed.zst"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["failed.zst", "next.zst"]
    (failure,) = writer.failures
    assert failure.startswith(f"step {step.index} not written: the device context was lost") and told == []


def test_any_other_failure_waiting_for_copies_stops_the_writer_and_tells_the_recorder(persister, tmp_path):
    writer, step, told = persister
    writer.submit(tmp_path / "broken.zst", step, ready=_raising("injected: the copies cannot be waited for"))
    writer.wait_idle()
    assert writer.written == [] and list(tmp_path.iterdir()) == []
    assert told == writer.failures and "writer thread died" in told[0] and "injected" in told[0]
    with pytest.raises(RuntimeError, match="writer thread is gone"):
        writer.submit(tmp_path / "later.zst", step)


def test_a_bundle_moved_away_as_soon_as_written_was_still_written(persister, tmp_path, monkeypatch, caplog):
    """A watcher that collects bundles the moment they appear (tests/e2e's serve test renames the
    folder) must not turn a written bundle into a failed write and stop recording."""
    import tracekit.record.persist as persist

    writer, step, told = persister
    write_steps = persist.write_steps

    def written_then_moved(path, *args):
        done = write_steps(path, *args)
        path.rename(path.with_name("collected.zst"))
        return done

    monkeypatch.setattr(persist, "write_steps", written_then_moved)
    with caplog.at_level("INFO", logger=persist.logger.name):
        writer.submit(tmp_path / "moved.zst", step, now=True)
    assert writer.written == [tmp_path / "moved.zst"] and writer.failures == [] and told == []
    assert (tmp_path / "collected.zst").exists() and "(moved since)" in caplog.text
