#!/usr/bin/env bash
# Record the quick run's float32 workload in several processes and replay each recording, writing
# per process (recordings and replays) what its compiled steps ran with
# (tools/probe_compiled_code.py: Inductor's modules and kernel configurations, and the binaries of
# Triton kernels compiled outside Inductor, with the ptxas in effect), to find which
# process-dependent choice makes a recording part from its replay (issue 28). On the GPU machine,
# after the kit's install calls:
#   bash tools/gpu_probe_recordings.sh --vllm 0.26 [--groups G] [--variants 'V[:ENV=VALUE,...] ...'] NAME[:ENV=VALUE,...] ...
# Each NAME records steps 0:40 of the GPU workload (float32, a 128-token budget, vLLM's defaults
# otherwise) with the ENV settings given, then replays them once per variant, the variants at
# once, each in a fresh process (default variant: `plain`). In a variant's settings `@torch` and
# `@triton` stand for torch's and Triton's own ptxas. G groups run the whole sequence at the same
# time, each with its own vLLM cache (as the quick run's lanes do); caches are wiped once, first.
# $OUT/probe.tgz holds per group and NAME the recording's manifest (NAME-record/), each variant's
# manifest (NAME-VARIANT/) and replay records (NAME-VARIANT.jsonl), and summary.txt: verdicts per
# replay, and how each replay's Triton binaries stand against its recording's.
set -uo pipefail
cd "$(dirname "$0")/.."
VLLM=0.26 groups=1 variants=plain
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) VLLM=$2; shift 2 ;;
    --groups) groups=$2; shift 2 ;;
    --variants) variants=$2; shift 2 ;;
    *) break ;;
  esac
done
case "$VLLM" in 0.26) KIT=.gpu-kit ;; 0.34) KIT=.gpu-kit34 ;; *) echo "--vllm 0.26|0.34" >&2; exit 2 ;; esac
source "$KIT/install.sh" env || exit 9
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-1}
TORCH_PTXAS=$(python3 -c "import torch, pathlib; print(pathlib.Path(torch.__file__).parent / 'bin' / 'ptxas')")
TRITON_PTXAS=$(python3 -c "import triton, pathlib; print(pathlib.Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'ptxas')")
echo "torch's ptxas: $("$TORCH_PTXAS" --version 2>&1 | tail -1); Triton's: $("$TRITON_PTXAS" --version 2>&1 | tail -1)"
W=/tmp/tracekit-probe P=/tmp/tracekit-probe-out
rm -rf "$W" "$P" ~/.cache/vllm* "/tmp/torchinductor_$(whoami)" ~/.triton && mkdir -p "$W" "$P"
PYTHONPATH="tests/gpu:${PYTHONPATH:-}" python3 -c "
import sys, pathlib; from conftest import _write_prompts; _write_prompts(pathlib.Path('$W/prompts.jsonl'), [])"

settings_of() {  # NAME:A=1,B=2 -> "A=1 B=2", with @torch and @triton resolved
  local spec=$1 settings=""
  [ "${spec%%:*}" != "$spec" ] && settings=${spec#*:}
  settings=${settings//,/ }
  settings=${settings//@torch/$TORCH_PTXAS}
  echo "${settings//@triton/$TRITON_PTXAS}"
}

run_group() {  # the whole sequence of recordings, each replayed once per variant, in group $1
  local group=$1 out="$P/g$1" work="$W/g$1"
  mkdir -p "$out" "$work"
  export VLLM_CACHE_ROOT=~/.cache/vllm-probe-$group
  for spec in "${specs[@]}"; do
    local name=${spec%%:*} started
    started=$(date +%s)
    env $(settings_of "$spec") python3 tools/probe_compiled_code.py "$out/$name-record" -- record -o "$work/$name/step{step}.zst" \
      --steps 0:40 --prompts "$W/prompts.jsonl" --max-tokens 12 --dtype float32 --max-num-batched-tokens 128 \
      > "$out/$name-record.log" 2>&1
    echo "g$group $name record rc=$? $(( $(date +%s) - started )) s"
    for variant in $variants; do
      local label=${variant%%:*}
      (started=$(date +%s)
       env $(settings_of "$variant") python3 tools/probe_compiled_code.py "$out/$name-$label" -- replay "$work/$name" \
         --keep-going --no-timing --json "$out/$name-$label.jsonl" > "$out/$name-$label.log" 2>&1
       echo "g$group $name $label replay rc=$? $(( $(date +%s) - started )) s:" \
         "$(grep -o '"verdict": "[a-z_]*"' "$out/$name-$label.jsonl" 2>/dev/null | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
       echo "== g$group $name-record vs $name-$label"
       python3 tools/probe_compiled_code.py --compare "$out/$name-record" "$out/$name-$label" 2>&1 | grep -v "^  [<>] c" ) &
    done
    wait
  done
}

specs=("$@")
for group in $(seq 1 "$groups"); do
  run_group "$group" > "$P/group$group.txt" 2>&1 &
done
wait
cat "$P"/group*.txt | tee "$P/summary.txt"
tar czf "$OUT/probe.tgz" -C "$P" . && ls -la "$OUT"
