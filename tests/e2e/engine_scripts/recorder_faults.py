"""A recorder that breaks at each stage leaves the engine's outputs exactly as unarmed.

One engine (of the runner kind the environment picks), the same requests each time:

  unarmed        the reference token ids
  arm            the adapter meets a runner attribute it does not know while arming
  capture        ... while copying a firing step to host
  unserialisable a request's SamplingParams.extra_args holds a value no bundle can store
  disk_full      the bundle write fails part-way (the process may write at most 16 KiB per file:
                 RLIMIT_FSIZE with SIGXFSZ ignored, so write() fails with EFBIG like a full disk)
  writer_dies    the writer thread dies (SystemExit inside it) after its first bundle
  deferred_check armed on non-finite outputs alone, the check's device flag not yet passed at
                 the logits (as on a GPU), then failing to be read when the step's output
                 receiver is built

Each stage but the last records every step; for each: the token ids, the recorder's failures, what it
wrote, and the files left in its folder.

    python recorder_faults.py RESULT.json WORK_DIR
"""

import resource
import signal
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

from engine_common import REPEATABLE_PROMPTS, REPEATABLE_SAMPLING, eager_llm, generate_token_ids, patched, write_result

from tracekit.graphs.host_copy import DeviceFlag
from tracekit.integrations.vllm.engines.build import adapter_of
from tracekit.record import persist
from tracekit.record.api import recording

MAX_TOKENS = 6
FILE_SIZE_LIMIT = 16 << 10  # a bundle of this engine's steps is ~100 KiB


def generate(llm, sampling=REPEATABLE_SAMPLING):
    llm.reset_prefix_cache()  # every run computes every prompt token: the same batches each time
    return generate_token_ids(llm, REPEATABLE_PROMPTS, sampling, MAX_TOKENS)


def missing_attribute(self, *args, **kwargs):
    return self.runner.attribute_a_later_vllm_renamed


@contextmanager
def file_size_limit(limit):
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)


def flag_fails_once_deferred():
    """`DeviceFlag.ready`: not yet (a GPU still running the step) when first asked, then failing."""
    asked = set()

    def ready(flag):
        if id(flag) in asked:
            raise ValueError("injected: the non-finite check cannot be read")
        asked.add(id(flag))
        return False

    return patched(DeviceFlag, "ready", ready)


def writer_dies_after_first_bundle():
    original, calls = persist.write_steps, [0]

    def write_bundle(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 1:
            raise SystemExit("injected: the writer thread dies")
        return original(*args, **kwargs)

    return patched(persist, "write_steps", write_bundle)


if __name__ == "__main__":
    work = Path(sys.argv[2])
    llm = eager_llm()
    adapter_class = type(adapter_of(llm))
    result = {"runner": adapter_class.kind, "unarmed": generate(llm)}
    unserialisable = [{**params, "extra_args": {"on_done": object()}} for params in REPEATABLE_SAMPLING]
    result["unarmed_with_extra_args"] = generate(llm, unserialisable)

    every_step = {"steps": "0:", "max_bundles": 1000}
    stages = {
        "arm": (lambda: patched(adapter_class, "observe", missing_attribute), REPEATABLE_SAMPLING, every_step),
        "capture": (lambda: patched(adapter_class, "request_states", missing_attribute), REPEATABLE_SAMPLING,
                    every_step),
        "unserialisable": (nullcontext, unserialisable, every_step),
        "disk_full": (lambda: file_size_limit(FILE_SIZE_LIMIT), REPEATABLE_SAMPLING, every_step),
        "writer_dies": (writer_dies_after_first_bundle, REPEATABLE_SAMPLING, every_step),
        "deferred_check": (flag_fails_once_deferred, REPEATABLE_SAMPLING, {"on": ("nonfinite",)}),
    }
    for name, (fault, sampling, triggers) in stages.items():
        folder = work / name
        folder.mkdir()
        with fault(), recording(llm, f"{folder}/step{{step}}.zst", **triggers) as recorder:
            outputs = generate(llm, sampling)
            recorder.wait_for_writes()  # a write fails, or the writer dies, on its own thread
            still_armed = recorder.armed
        result[name] = {
            "outputs": outputs,
            "failures": recorder.failures,
            "still_armed": still_armed,
            "written": [str(p) for p in recorder.written],
            "files": sorted(p.name for p in folder.iterdir()),
        }
    write_result(result)
