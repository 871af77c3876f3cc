"""One process of the kernel-copy tests: two compiled graphs whose modules each bind a copy of one
reduction kernel's source (`norm`, and `norm_then_project`, which feeds the same norm to a
matmul), run with the lookup table giving that kernel each of its candidate configurations in
turn (references), then with each graph's copy given a configuration of its own
(`kernel_choices.choices_applied` with `KernelCopy` entries). On this CPU (`--cpu`, through
Triton's interpreter: tests/harness/triton_on_cpu.py) or on CUDA, where the kernels are built in
the process or in Inductor's compile workers as TORCHINDUCTOR_COMPILE_THREADS says.

    python kernel_copies_script.py RESULT.json [--cpu]

Each run compiles afresh, in an Inductor cache of its own (`fresh_cache`). RESULT.json holds per
run each function's output digest (sha256 of its bytes: bit-exactness is the question), what
launched (`launched_choices`, with its copies), each kernel as its graph module bound it when
loaded (candidates, and whether a compile worker built it), and, where choices were applied,
their comparison and what the replay did with the copies.
"""

import hashlib
import json
import sys
from pathlib import Path

CPU = "--cpu" in sys.argv
if CPU:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
    import triton_on_cpu

    triton_on_cpu.install()

import torch  # noqa: E402
from torch._inductor.codecache import PyCodeCache  # noqa: E402
from torch._inductor.runtime.triton_heuristics import CachingAutotuner  # noqa: E402
from torch._inductor.utils import fresh_cache  # noqa: E402

from tracekit.format.schema import KernelChoice, KernelCopy  # noqa: E402
from tracekit.graphs import kernel_choices  # noqa: E402

DEVICE = "cpu" if CPU else "cuda"
MAX_REFERENCES = 4


def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w / (x * x).sum(-1, keepdim=True)


def norm_then_project(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return norm(x, w) @ m


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def candidates_of(kernel: CachingAutotuner) -> list[dict[str, int]]:
    """What the kernel can still launch with, as loaded: its compiled configurations (under the
    interpreter, the ones it was generated with)."""
    if kernel.compile_results:
        return [kernel_choices.config_fields(result.config) for result in kernel.compile_results]
    return [kernel_choices.config_fields(config) for config in kernel.configs or []]


class LoadSpy:
    """Each kernel a graph module binds, as the module is loaded (before it first runs)."""

    def __init__(self):
        self.loaded: list[dict] = []
        self.original = PyCodeCache.__dict__["load_by_key_path"]

    def __enter__(self):
        def load_by_key_path(cls, key, path, *args, **kwargs):
            module = self.original.__func__(cls, key, path, *args, **kwargs)
            graph = kernel_choices._graph_of(module, path)
            for name, value in vars(module).items():
                if graph is not None and isinstance(value, CachingAutotuner):
                    self.loaded.append({"graph": graph, "binding": name, "hash": kernel_choices.lookup_hash(value),
                                        "candidates": candidates_of(value),
                                        "worker_built": getattr(value.fn, "fn", None) is None,
                                        "object": id(value)})
            return module

        PyCodeCache.load_by_key_path = classmethod(load_by_key_path)
        return self

    def __exit__(self, *exc):
        PyCodeCache.load_by_key_path = self.original


def run(choices: list[KernelChoice]) -> dict:
    """Compile and run both functions afresh under `choices`."""
    generator = torch.Generator().manual_seed(0)
    x, w, m = (torch.randn(*shape, generator=generator).to(DEVICE) for shape in ((16, 4096), (4096,), (4096, 8)))
    torch._dynamo.reset()
    outputs, graphs = {}, {}
    with fresh_cache(), LoadSpy() as spy, kernel_choices.choices_applied(choices) as applied:
        for name, function, args in (("a", norm, (x, w)), ("b", norm_then_project, (x, w, m))):
            before = len(spy.loaded)
            out = torch.compile(function)(*args)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            outputs[name] = digest(out)
            graphs[name] = sorted({entry["graph"] for entry in spy.loaded[before:]})
        launched = kernel_choices.launched_choices(only_chosen=False)
    return {"outputs": outputs, "graphs": graphs, "loaded": spy.loaded,
            "launched": [choice.to_plain() for choice in launched],
            "compared": kernel_choices.compare(choices, launched, applied),
            "pinned": applied.pinned, "unapplied": applied.unapplied}


def shared_kernel(record: dict) -> dict | None:
    """The kernel whose copies both graphs bind, with what it can launch with."""
    graph_a, graph_b = record["graphs"]["a"], record["graphs"]["b"]
    for entry in record["loaded"]:
        if entry["graph"] in graph_a and entry["hash"] is not None:
            twin = next((other for other in record["loaded"] if other["graph"] in graph_b
                         and other["hash"] == entry["hash"]), None)
            if twin is not None:
                return {"hash": entry["hash"], "binding_a": entry["binding"], "binding_b": twin["binding"],
                        "graph_a": entry["graph"], "graph_b": twin["graph"], "candidates": entry["candidates"]}
    return None


def discriminating_pair(references: list[dict]) -> list[int] | None:
    """Two candidates under which both functions' outputs differ (or, failing that, one's)."""
    pairs = [(i, j) for i in range(len(references)) for j in range(i + 1, len(references))]
    for wanted in (2, 1):
        for i, j in pairs:
            if sum(references[i]["outputs"][name] != references[j]["outputs"][name] for name in "ab") >= wanted:
                return [i, j]
    return None


if __name__ == "__main__":
    if DEVICE == "cuda" and torch._inductor.config.compile_threads > 1:
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()
        AsyncCompile.wait_pool_ready()
    result: dict = {"device": DEVICE, "record": run([])}
    shared = result["shared"] = shared_kernel(result["record"])
    if shared is not None:
        kernel = shared["binding_a"]
        candidates = shared["candidates"][:MAX_REFERENCES]
        references = [run([KernelChoice(kernel, shared["hash"], config)]) for config in candidates]
        result["references"] = references
        pair = result["pair"] = discriminating_pair(references)
        if pair is not None:
            first, second = (candidates[index] for index in pair)
            pinned = KernelChoice(kernel, shared["hash"], first, other_configs=[second], copies=[
                KernelCopy(shared["graph_a"], shared["binding_a"], first),
                KernelCopy(shared["graph_b"], shared["binding_b"], second)])
            result["applied"] = pinned.to_plain()
            result["pinned"] = run([pinned])
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
