"""One process of the kernel-choice test (tests/graphs/test_gpu_kernel_choices.py): compile a
row-wise reduction with Inductor on CUDA, run it once, and report what its Triton kernels were
given to choose from and what they launched with.

    python kernel_choices_script.py RESULT.json [CHOICES.json]

With CHOICES.json (a list of `KernelChoice` maps), the kernels run under
`kernel_choices.choices_applied`. Each run uses a fresh Inductor cache (TORCHINDUCTOR_CACHE_DIR,
set by the caller), so nothing is read from an earlier process. The candidates are read where
Inductor builds each kernel: in this process when the caller sets TORCHINDUCTOR_COMPILE_THREADS=1
(else in compile workers, and none are reported).
"""

import json
import sys

import torch

from tracekit.format.schema import KernelChoice
from tracekit.graphs import kernel_choices


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


if __name__ == "__main__":
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    candidates: dict[str, list[dict[str, int]]] = {}
    original_init = CachingAutotuner.__init__

    def spy(self, fn, triton_meta, configs, *args, **kwargs):  # what each kernel was generated with
        original_init(self, fn, triton_meta, configs, *args, **kwargs)
        digest = kernel_choices.lookup_hash(self)
        if digest is not None:
            candidates[digest] = [kernel_choices.config_fields(config) for config in configs]

    CachingAutotuner.__init__ = spy
    recorded = [KernelChoice.from_plain(plain) for plain in json.loads(open(sys.argv[2]).read())] if len(sys.argv) > 2 else []
    torch.manual_seed(0)
    x = torch.randn(96, 4096, device="cuda", dtype=torch.float32)
    weight = torch.randn(4096, device="cuda", dtype=torch.float32)
    with kernel_choices.choices_applied(recorded):
        out = torch.compile(rms_norm)(x, weight)
        torch.cuda.synchronize()
    launched = kernel_choices.launched_choices()
    result = {
        "candidates": candidates,
        "launched": [choice.to_plain() for choice in launched],
        "compared": kernel_choices.compare(recorded, launched),
        "checksum": float(out.double().sum()),
    }
    with open(sys.argv[1], "w") as stream:
        json.dump(result, stream)
