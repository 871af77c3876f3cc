#!/usr/bin/env bash
# Record the quick run's float32 workload in several processes and replay each recording, writing
# per recording process what its compiled steps ran with (tools/probe_compiled_code.py; a replay
# process lists nothing at its exit, and reports its own kernels against the bundle's), to find
# which process-dependent choice makes a recording part from its replay (issue 28). On the GPU machine,
# after the kit's install calls:
#   bash tools/gpu_probe_recordings.sh --vllm 0.26 NAME[:ENV=VALUE,...] ...
# Each NAME records steps 0:40 of the GPU workload (float32, a 128-token budget, vLLM's defaults
# otherwise) with the ENV settings given, then replays them in a fresh process. Caches are wiped
# once, before the first. $OUT/probe/NAME-record holds the recording's manifest; NAME.jsonl the
# replay's records; diffs.txt the recordings' manifests and steps compared (`tracekit diff`).
set -uo pipefail
cd "$(dirname "$0")/.."
VLLM=0.26
if [ "${1:-}" = "--vllm" ]; then VLLM=$2; shift 2; fi
case "$VLLM" in 0.26) KIT=.gpu-kit ;; 0.34) KIT=.gpu-kit34 ;; *) echo "--vllm 0.26|0.34" >&2; exit 2 ;; esac
source "$KIT/install.sh" env || exit 9
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-1}
W=/tmp/tracekit-probe P="$OUT/probe"
rm -rf "$W" ~/.cache/vllm "/tmp/torchinductor_$(whoami)" ~/.triton && mkdir -p "$W" "$P"
PYTHONPATH="tests/gpu:${PYTHONPATH:-}" python3 -c "
import sys, pathlib; from conftest import _write_prompts; _write_prompts(pathlib.Path('$W/prompts.jsonl'), [])"
names=()
for spec in "$@"; do
  name=${spec%%:*} settings=""
  [ "$spec" != "$name" ] && settings=${spec#*:}
  names+=("$name")
  mkdir -p "$W/$name"
  started=$(date +%s)
  env ${settings//,/ } python3 tools/probe_compiled_code.py "$P/$name-record" -- record -o "$W/$name/step{step}.zst" \
    --steps 0:40 --prompts "$W/prompts.jsonl" --max-tokens 12 --dtype float32 --max-num-batched-tokens 128 \
    > "$P/$name-record.log" 2>&1
  echo "$name record rc=$? $(( $(date +%s) - started )) s"
  started=$(date +%s)
  python3 -m tracekit replay "$W/$name" --keep-going --no-timing --json "$P/$name.jsonl" > "$P/$name-replay.log" 2>&1
  echo "$name replay rc=$? $(( $(date +%s) - started )) s: $(grep -o '"verdict": "[a-z_]*"' "$P/$name.jsonl" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
done
first=${names[0]}
for name in "${names[@]:1}"; do
  echo "== $first vs $name (records)"; python3 tools/probe_compiled_code.py --compare "$P/$first-record" "$P/$name-record"
  for bundle in "$W/$first"/step*.zst; do
    step=$(basename "$bundle")
    [ -f "$W/$name/$step" ] && python3 -m tracekit diff --json "$bundle" "$W/$name/$step" 2>&1 | python3 -c "
import json, sys
text = sys.stdin.read()
try:
    parted = [t for t in json.loads(text)['tensors'] if not t['bit_exact'] and 'generator_state' not in t['name']]
except ValueError:
    parted = [{'name': text.strip()[-200:], 'relative_rms': None}]
print('$first/$step vs $name:', ', '.join(f\"{t['name'].split('/', 2)[-1]} {t['relative_rms']}\" for t in parted) or 'equal')"
  done
done 2>&1 | tee "$P/diffs.txt"
