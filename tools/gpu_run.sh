#!/usr/bin/env bash
# Run tracekit's GPU tests (tests/gpu: real vLLM engines; tests/graphs: the graph layer) on the lent
# GPU machine, under the vLLM release given (default 0.26), through its kit of ../shared/gpu/:
#   --vllm 0.26   kit .gpu-kit/    (make-vllm-kit.sh: vLLM 0.26.0 on the image's torch 2.11)
#   --vllm 0.34   kit .gpu-kit34/  (make-vllm034-kit.sh: vLLM 0.34.0 with torch 2.14)
#
# Here, once per kit:
#   bash ../shared/gpu/make-vllm-kit.sh    && bash tools/gpu_run.sh --vllm 0.26 --add-kit-extras   (~40 s)
#   bash ../shared/gpu/make-vllm034-kit.sh && bash tools/gpu_run.sh --vllm 0.34 --add-kit-extras   (~9 min)
#   (the extras: the wheels tracekit and its tests need that the GPU image lacks, pytest first, 2.7 MB;
#   for 0.26 they go to .gpu-kit/extras, and the last 4 MiB of vllm.part00 move into vllm.part00z, part00
#   beside this checkout being over the 64 MiB a call carries; for 0.34 they go to .gpu-kit34/extra,
#   which the kit's `env` step installs first on PYTHONPATH)
#
# There, vLLM 0.26, four `run` calls back to back (../shared/gpu/README.md):
#   carry [".gpu-kit/vllm.part00", ".gpu-kit/install.sh"]
#   carry [".gpu-kit/vllm.part01", ".gpu-kit/install.sh", ".gpu-kit/extras"]
#   carry [".gpu-kit/deps", ".gpu-kit/install.sh"]
#   carry [".gpu-kit/vllm.part00z", ".gpu-kit/install.sh"]   (deps, 56 MiB, and part00z with this
#   checkout exceed one call's 64 MiB: four calls)
#   command: bash .gpu-kit/install.sh stash && bash tools/gpu_run.sh --vllm 0.26 --stash-extras
# and the fourth runs the tests:
#   bash .gpu-kit/install.sh stash && bash tools/gpu_run.sh --vllm 0.26 --stash-extras && bash tools/gpu_run.sh --vllm 0.26 [PYTEST ARGS]
# There, vLLM 0.34, seven calls back to back, one kit part each:
#   carry [".gpu-kit34/kit.partNN", ".gpu-kit34/install.sh", ".gpu-kit34/extract.py", ".gpu-kit34/index.txt"]
#   command: bash .gpu-kit34/install.sh stash
# the last one (kit.part06) also carries ".gpu-kit34/extra" and runs the tests:
#   bash .gpu-kit34/install.sh stash && bash tools/gpu_run.sh --vllm 0.34 [PYTEST ARGS, e.g. -k v2-bf16-graphs]
# A later call while the machine is warm carries the kit's install.sh (and extract.py, index.txt).
# On every change to tracekit/integrations, record, replay or graphs, the quick run, on a committed
# tree (the hash written out: the GPU has no .git), once per release:
#   bash tools/gpu_run.sh --vllm 0.26 --quick $(git rev-parse HEAD) [-k ...]
# (under a call's 600 s limit, TRACEKIT_GPU_SECONDS=540 keeps what a cut run found; see below)
# then here: python tools/gpu_last_run.py --merge RUN.json... --out tests/gpu/last-run.json, committed.
#
# Results land in $OUT/vllm-X.Y: pytest.log, junit.xml, every replay's JSON records (records.tgz), a
# few bundles that did not reproduce (bundles/; the rest stay on the GPU machine, /tmp/tracekit-gpu-tmp),
# and the steps recorded for replays across releases (across-releases/: commit them to
# traces/h200-vllmXYZ-greedy/ so that the other release's run replays them).
set -uo pipefail
cd "$(dirname "$0")/.."
VLLM=0.26
if [ "${1:-}" = "--vllm" ]; then VLLM=${2:-}; shift 2; fi
case "$VLLM" in
  0.26) KIT=.gpu-kit EXTRAS=.gpu-kit/extras ;;
  0.34) KIT=.gpu-kit34 EXTRAS=.gpu-kit34/extra ;;
  *) echo "tools/gpu_run.sh: --vllm takes 0.26 or 0.34, not '$VLLM'" >&2; exit 2 ;;
esac
if [ "${1:-}" = "--add-kit-extras" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$EXTRAS" msgpack click rich markdown-it-py mdurl pygments pytest pluggy iniconfig || exit $?
  part=.gpu-kit/vllm.part00 keep=$((56 * 1024 * 1024))
  if [ "$VLLM" = 0.26 ] && [ "$(stat -c %s $part)" -gt $keep ]; then
    tail -c +$((keep + 1)) $part > .gpu-kit/vllm.part00z && truncate -s $keep $part || exit $?
  fi
  if [ "$VLLM" = 0.34 ] && [ "$(stat -c %s $KIT/kit.part00)" -gt $keep ]; then
    # 60 MiB parts leave too little room for this checkout (~5 MiB) in a call's 64 MiB: cut again
    # at 56 MiB (the parts are one byte stream; extract.py reads them in order)
    chmod u+w $KIT && cat $KIT/kit.part* > $KIT/kit.all && rm $KIT/kit.part* &&
      split -b $keep -d -a 2 $KIT/kit.all $KIT/kit.part && rm $KIT/kit.all || exit $?
  fi
  exit 0
fi
if [ "${1:-}" = "--stash-extras" ]; then  # 0.26: beside the kit's own wheels, which its `env` step installs
  [ "$VLLM" = 0.26 ] || { echo "--stash-extras is for the 0.26 kit (0.34's env step installs $EXTRAS)" >&2; exit 2; }
  mkdir -p /tmp/vllm-kit/wheels && cp .gpu-kit/extras/*.whl /tmp/vllm-kit/wheels/ && ls .gpu-kit/extras | wc -l
  exit $?
fi
quick=""
if [ "${1:-}" = "--quick" ]; then   # --quick COMMIT: the run to make on every engine-facing change
  quick=${2:?"--quick needs the commit the working tree is (git rev-parse HEAD, run here)"}; shift 2
  # a hash typed out by hand has been wrong twice: refuse anything but 40 hex digits
  [[ "$quick" =~ ^[0-9a-f]{40}$ ]] || { echo "--quick takes the full 40-digit hash of HEAD (git rev-parse HEAD, here), not '$quick'" >&2; exit 2; }
fi
source "$KIT/install.sh" env || exit 9
# TRACEKIT_GPU_LANE=NAME: one of several runs at once on the machine (each its own -k), results in
# $OUT/vllm-X.Y-NAME, its own temporary folder and vLLM cache: the tiny engines use a few GiB each,
# within what vLLM's start-up check leaves (free memory >= gpu_memory_utilization * total)
LANE=${TRACEKIT_GPU_LANE:+-$TRACEKIT_GPU_LANE}
[[ "$LANE" =~ ^(-[a-z0-9]+)?$ ]] || { echo "TRACEKIT_GPU_LANE takes letters and digits, not '$TRACEKIT_GPU_LANE'" >&2; exit 2; }
[ -z "$LANE" ] || export VLLM_CACHE_ROOT="$HOME/.cache/vllm$LANE"
OUT=${OUT:-/tmp/tracekit-gpu}/vllm-$VLLM$LANE
mkdir -p "$OUT"
# (written outside $OUT and copied back one level deep: a call brings back no deeper folder)
export TRACEKIT_GPU_ACROSS_RELEASES_OUT=/tmp/tracekit-gpu-across$LANE
# each failure's traceback as it happens (tests/gpu/conftest.py): a run cut short keeps them
export TRACEKIT_GPU_FAILURES="$OUT/failures.txt"
rm -f "$TRACEKIT_GPU_FAILURES"
rm -rf "$TRACEKIT_GPU_ACROSS_RELEASES_OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
TMP=/tmp/tracekit-gpu-tmp/vllm-$VLLM$LANE
rm -rf "$TMP" && mkdir -p "$(dirname "$TMP")"
started=$(date +%s)
if [ -n "$quick" ]; then
  # V2 and V1 with vLLM's defaults, a float32 workload recorded twice, and the kernel choices
  # alone (tests/gpu/test_gpu_quick.py, tests/graphs/test_gpu_kernel_choices.py): under 9 minutes.
  # (a run may be split over calls with -k: each call's configurations come back in its own
  # last-run.json, and tools/gpu_last_run.py --merge joins the calls' files here)
  export TRACEKIT_GPU_SUMMARY="$OUT/quick-summary.json"
  set -- tests/gpu/test_gpu_quick.py tests/graphs/test_gpu_kernel_choices.py "$@"
else
  set -- tests/gpu "$@"
fi
# TRACEKIT_GPU_PROBE=1: every tracekit process of the tests runs under tools/probe_compiled_code.py
# (tests/gpu/gpu_support.py); the manifests come back in $OUT/probe.tgz, numbered in the order the
# processes ran (commands.txt): compare a recording's with its replay's with
# `python tools/probe_compiled_code.py --compare A B` (issue 28's float32 recordings).
if [ -n "${TRACEKIT_GPU_PROBE:-}" ]; then
  export TRACEKIT_GPU_PROBE_DIR=/tmp/tracekit-gpu-probe$LANE
  rm -rf "$TRACEKIT_GPU_PROBE_DIR" && mkdir -p "$TRACEKIT_GPU_PROBE_DIR/cublaslt"
  # and cuBLASLt traces every matmul it launches with the algorithm it chose (which the manifests
  # do not list), one log per process: cublaslt/PID.log, PID as in that process's manifest
  export CUBLASLT_LOG_LEVEL=2 CUBLASLT_LOG_FILE="$TRACEKIT_GPU_PROBE_DIR/cublaslt/%i.log"
fi
# TRACEKIT_GPU_SECONDS=S: pytest is interrupted after S seconds (SIGINT: the test in progress
# stops, its engine process is killed, the session ends as usual), so that a run the call's limit
# would cut still writes its JUnit file, records, failures and last-run.json: give S about a
# minute under the call's limit.
interrupt=()
[ -z "${TRACEKIT_GPU_SECONDS:-}" ] || interrupt=(timeout --signal=INT --kill-after=30 "$TRACEKIT_GPU_SECONDS")
"${interrupt[@]}" python3 -m pytest -v -rs -p no:cacheprovider --basetemp "$TMP" --junitxml "$OUT/junit.xml" "$@" \
  2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
cut=()
[ "$status" != 124 ] || cut=(--cut "pytest interrupted at TRACEKIT_GPU_SECONDS=$TRACEKIT_GPU_SECONDS, in the test after the last one the JUnit file lists")
if [ -n "$quick" ]; then
  python3 tools/gpu_last_run.py --commit "$quick" --seconds $(( $(date +%s) - started )) --junit "$OUT/junit.xml" \
    --summary "$OUT/quick-summary.json" --gpu "$OUT/gpu.txt" --out "$OUT/last-run.json" "${cut[@]}"
fi
[ ! -d "${TRACEKIT_GPU_PROBE_DIR:-}" ] || tar czf "$OUT/probe.tgz" -C "$TRACEKIT_GPU_PROBE_DIR" .
for kind in "" -drafted; do  # greedy and drafted steps (tests/gpu/test_gpu_across_releases.py)
  if [ -d "$TRACEKIT_GPU_ACROSS_RELEASES_OUT/vllm-$VLLM$kind" ]; then
    mkdir -p "$OUT/across-releases$kind" && cp "$TRACEKIT_GPU_ACROSS_RELEASES_OUT/vllm-$VLLM$kind"/*.zst "$OUT/across-releases$kind/"
  fi
done
(cd "$TMP" && find . -name "*.jsonl" -o -name "result.json" | tar czf "$OUT/records.tgz" -T -)
# The bundles whose replay was neither bit-exact nor a planned control come back too (at most 3).
python3 - "$TMP" "$OUT/bundles" <<'PY'
import json, pathlib, shutil, sys
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
picked = []
for records in tmp.rglob("replays.jsonl"):
    for line in records.read_text().splitlines():
        record = json.loads(line)
        bundle = pathlib.Path(record["bundle"])
        if record.get("verdict") not in ("bit_exact", "crashed") and "controls" not in bundle.parts and bundle.exists():
            picked.append(bundle)
out.mkdir(parents=True, exist_ok=True)
for bundle in picked[:3]:
    shutil.copy(bundle, out / f"{bundle.parent.parent.name}-{bundle.name}")
PY
exit "$status"
