"""The copies a firing step makes and the check every event-armed step makes (issue 20), on the
device this machine has (CPU: copied at once; the CUDA path runs in tests/gpu)."""

import torch

from tracekit.graphs.device import get_device_backend
from tracekit.graphs.host_copy import DeviceFlag, HostCopy, all_finite, context_lost


def test_gather_and_copy_give_new_host_tensors_of_the_rows_asked():
    cache = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    copy = HostCopy(get_device_backend("cpu"))
    rows = copy.gather(cache, 1, [4, 1])
    whole = copy.copy(cache[0])
    copy.finish().wait()
    assert torch.equal(rows, cache[:, [4, 1]]) and torch.equal(whole, cache[0])
    cache.zero_()  # copies, not views
    assert rows.abs().sum() > 0 and whole.abs().sum() > 0
    assert copy.bytes == rows.numel() * 4 + whole.numel() * 4


def test_the_finite_check_catches_nan_and_inf_anywhere_and_confirms_exactly():
    hidden, logits = torch.randn(5, 8), torch.randn(3, 16)
    assert bool(all_finite([hidden[:4], logits])) and bool(all_finite([hidden, logits], exact=True))
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = logits.clone()
        poisoned[2, 7] = bad
        assert not bool(all_finite([hidden, poisoned])) and not bool(all_finite([hidden, poisoned], exact=True))
    hidden[4, 0] = float("nan")  # a row past the ones checked
    assert bool(all_finite([hidden[:4], logits]))
    assert bool(all_finite([None, torch.tensor([1, 2]), torch.empty(0)]))  # nothing to check: finite
    assert DeviceFlag(all_finite([logits]), get_device_backend("cpu")).ready()
    assert DeviceFlag(all_finite([hidden]), get_device_backend("cpu")).value() is False


def test_a_lost_device_context_is_told_from_other_failures():
    assert context_lost(RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be ..."))
    assert context_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not context_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not context_lost(ValueError("injected failure in sampling"))
