#!/usr/bin/env bash
# Whether the ptxas release that built vLLM's own Triton kernels decides a float32 step's rounding
# (issue 28). Records the quick run's float32 workload twice (the second process finds the first's
# compile caches and, in every run seen, gets its vLLM kernels built by Triton's own ptxas rather
# than torch's), then replays the second recording twice at once: with its kernels built as
# recorded, and with its builds rewritten to another release (the first recording's where it
# differs), as a replay that did not carry the builds could have built them. On the GPU machine,
# after the kit's install calls:
#   bash tools/gpu_probe_builds.sh
# Prints per recording the ISAs its vLLM kernels were built for, and per replay its verdicts,
# its kernels' builds against the bundle's, and each parted step's first divergence; each process
# runs under tools/probe_compiled_code.py, and the second recording's manifest is compared with
# each replay's (Inductor's own kernels' binaries included: the next candidate if both replays
# reproduce).
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu-kit/install.sh env >/dev/null || exit 9
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 VLLM_USE_V2_MODEL_RUNNER=1
W=/tmp/tracekit-probe-builds
rm -rf "$W" ~/.cache/vllm "/tmp/torchinductor_$(whoami)" ~/.triton && mkdir -p "$W"
PYTHONPATH="tests/gpu:${PYTHONPATH:-}" python3 -c "
import pathlib; from conftest import _write_prompts; _write_prompts(pathlib.Path('$W/prompts.jsonl'), [])"
for name in first second; do
  mkdir -p "$W/$name"
  started=$(date +%s)
  python3 tools/probe_compiled_code.py "$W/$name-manifest" -- record -o "$W/$name/step{step}.zst" --steps 0:40 --prompts "$W/prompts.jsonl" --max-tokens 12 \
    --dtype float32 --max-num-batched-tokens 128 > "$W/$name.log" 2>&1
  echo "$name recorded: rc $? in $(( $(date +%s) - started )) s"
done
python3 - "$W" <<'EOF'
import sys
from pathlib import Path

from tracekit.format.content import load_step
from tracekit.format.rewrite import rewrite_bundle
from tracekit.graphs.kernel_builds import ptxas_by_isa

work = Path(sys.argv[1])
isas = {}
for name in ("first", "second"):
    content, _ = load_step(work / name / "step0.zst", None)
    isas[name] = sorted({build.ptx_isa for build in content.engine.kernel_builds})
    print(f"{name}: vLLM's kernels built for PTX ISA {isas[name]} ({len(content.engine.kernel_builds)} builds)")
other = next((isa for isa in isas["first"] + sorted(ptxas_by_isa()) if isa not in isas["second"]), None)
print(f"the swapped replay asks for {other} (this machine's ptxas: {ptxas_by_isa()})")
(work / "swapped").mkdir()


def built_by_other(metadata, tensors):
    for build in metadata["engine"].get("kernel_builds", []):
        build["ptx_isa"] = other


for bundle in sorted((work / "second").glob("step*.zst")):
    rewrite_bundle(bundle, work / "swapped" / bundle.name, built_by_other)
EOF
for variant in second swapped; do
  python3 tools/probe_compiled_code.py "$W/$variant-replay-manifest" -- replay "$W/$variant" --keep-going --no-timing --json "$W/$variant.jsonl" > "$W/$variant-replay.log" 2>&1 &
done
wait
for variant in second swapped; do
  python3 - "$W/$variant.jsonl" "$variant" <<'EOF'
import json
import sys
from collections import Counter

records = [json.loads(line) for line in open(sys.argv[1])]
print(f"== replay of {sys.argv[2]}: {dict(Counter(r['verdict'] for r in records))}")
first = records[0].get("kernel_builds") or {}
print("  builds:", {key: len(value) for key, value in first.items()}, (first.get("other") or [""])[0][:160])
for r in records:
    if r["verdict"] != "bit_exact":
        parted = [(c["item"], c.get("relative_rms")) for c in r["checks"] if not c["bit_exact"] and c.get("decides", True)]
        print(f"  {r['name']}: {r['verdict']} at {r.get('first_divergence')}: {parted[:3]}")
EOF
done
for variant in second swapped; do
  echo "== the second recording's process vs the replay of $variant"
  python3 tools/probe_compiled_code.py --compare "$W/second-manifest" "$W/$variant-replay-manifest" | grep -v "^  [<>] c"
done
