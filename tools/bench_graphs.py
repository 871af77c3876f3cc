"""Hand-run benchmark of the graph layer on a CUDA device: one batch of the toy transformer timed
eager, compiled (Inductor), as a one-shot graph and through the piecewise backend (Inductor pieces,
one graph per piece), with each mode's median relative to eager.

    python3 tools/bench_graphs.py [--tokens 8] [--hidden 1024] [--layers 8] [--out bench.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from tracekit.graphs.capture_table import CaptureTable
from tracekit.graphs.device import get_device_backend
from tracekit.graphs.oneshot import capture_and_time
from tracekit.graphs.piecewise import PiecewiseGraphBackend
from tracekit.graphs.timing import time_callable

# The toy model is a test model: it lives with the graph tests, not in the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "graphs"))
from toy_transformer import ATTENTION_OP, ToyTransformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--out", help="also write the results here as JSON")
    args = parser.parse_args()

    device = get_device_backend("cuda")
    device.require_graphs()
    torch.manual_seed(0)
    model = ToyTransformer(hidden=args.hidden, heads=args.hidden // 64, layers=args.layers).cuda()
    ids = torch.randint(0, 512, (args.tokens,), device="cuda")
    positions = torch.arange(args.tokens, device="cuda")
    timing = dict(iters=args.iters, samples=args.samples, backend=device, warmup_s=1.0)

    compiled = torch.compile(model, fullgraph=True)
    table = CaptureTable(
        mode="piecewise", capture_sizes=(args.tokens,), compile_sizes=(args.tokens,), num_warmups=1
    )
    piecewise = PiecewiseGraphBackend(table, [ATTENTION_OP], device, compiler="inductor")
    piecewise_model = torch.compile(model, backend=piecewise, fullgraph=True)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(positions, 0)

    with torch.no_grad():
        # Compile, warm up and capture before any timing.
        for _ in range(table.num_warmups + 2):
            compiled(ids, positions)
            piecewise_model(ids, positions)
        results = {
            "eager": time_callable(lambda: model(ids, positions), **timing),
            "compiled": time_callable(lambda: compiled(ids, positions), **timing),
        }
        one_shot = capture_and_time(
            lambda: model(ids, positions), model.kv_caches(), device, args.iters, args.samples
        )
        results["graph"] = one_shot.report["latency_us"]
        results["graph_replay"] = one_shot.report["replay_us"]
        results["piecewise"] = time_callable(lambda: piecewise_model(ids, positions), **timing)
        reference = model(ids, positions)
        piecewise_error = (piecewise_model(ids, positions) - reference).abs().max().item()

    eager_median = results["eager"]["median"]
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": vars(args),
        "median_us": {mode: round(r["median"], 2) for mode, r in results.items()},
        "speedup_vs_eager": {m: round(eager_median / r["median"], 2) for m, r in results.items()},
        "sample_spread_pct": {m: round(r["sample_spread_pct"], 2) for m, r in results.items()},
        "graph_vs_eager": one_shot.report["graph_vs_eager"],
        "piecewise_max_abs_vs_eager": piecewise_error,
        "piecewise_counters": piecewise.counters.to_plain(),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"summary": summary, "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
