#!/usr/bin/env bash
# Run tracekit's GPU tests (tests/gpu: real vLLM 0.26 engines; tests/graphs: the graph layer) on
# the lent GPU machine, through the vLLM 0.26 kit of ../shared/gpu/.
#
# Here, once (~40 s):   bash ../shared/gpu/make-vllm-kit.sh && bash tools/gpu_run.sh --add-kit-extras
#   (the extras, .gpu-kit/extras: the wheels tracekit and its tests need that the GPU image may
#   lack: msgpack, click, rich, pytest, 2.7 MB)
#   (it also moves the last 4 MiB of vllm.part00 into vllm.part00z: part00 beside this checkout is
#   over the 64 MiB a call carries; the kit's install joins vllm.part* in name order)
# There, three `run` calls back to back (../shared/gpu/README.md); the second carries the extras
# too, the third the moved piece:
#   carry [".gpu-kit/vllm.part00", ".gpu-kit/install.sh"]
#   carry [".gpu-kit/vllm.part01", ".gpu-kit/install.sh", ".gpu-kit/extras"]
#   carry [".gpu-kit/deps", ".gpu-kit/install.sh", ".gpu-kit/vllm.part00z"]
#   command: bash .gpu-kit/install.sh stash && bash tools/gpu_run.sh --stash-extras
# and the third runs the tests (a later call while the machine is warm carries [".gpu-kit/install.sh"]):
#   bash .gpu-kit/install.sh stash && bash tools/gpu_run.sh [PYTEST ARGS, e.g. -k v2-bf16-graphs]
# On every change to tracekit/integrations, record, replay or graphs, the quick run, on a committed tree:
#   bash tools/gpu_run.sh --quick $(git rev-parse HEAD)      (the hash written out: the GPU has no .git)
# and commit the $OUT/last-run.json it writes as tests/gpu/last-run.json.
# Results land in $OUT: pytest.log, junit.xml, every replay's JSON records (records.tgz), and a few
# bundles that did not reproduce (bundles/; the rest stay on the GPU machine, /tmp/tracekit-gpu-tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--add-kit-extras" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu-kit/extras msgpack click rich markdown-it-py mdurl pygments pytest pluggy iniconfig || exit $?
  part=.gpu-kit/vllm.part00 keep=$((56 * 1024 * 1024))
  if [ "$(stat -c %s $part)" -gt $keep ]; then
    tail -c +$((keep + 1)) $part > .gpu-kit/vllm.part00z && truncate -s $keep $part
  fi
  exit $?
fi
if [ "${1:-}" = "--stash-extras" ]; then  # beside the kit's own wheels: its `env` step installs them all
  mkdir -p /tmp/vllm-kit/wheels && cp .gpu-kit/extras/*.whl /tmp/vllm-kit/wheels/ && ls .gpu-kit/extras | wc -l
  exit $?
fi
quick=""
if [ "${1:-}" = "--quick" ]; then   # --quick COMMIT: the run to make on every engine-facing change
  quick=${2:?"--quick needs the commit the working tree is (git rev-parse HEAD, run here)"}; shift 2
fi
source .gpu-kit/install.sh env || exit 9
OUT=${OUT:-/tmp/tracekit-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
TMP=/tmp/tracekit-gpu-tmp
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
python3 -m pytest -v -rs -p no:cacheprovider --basetemp "$TMP" --junitxml "$OUT/junit.xml" "$@" \
  2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
if [ -n "$quick" ]; then
  python3 tools/gpu_last_run.py --commit "$quick" --seconds $(( $(date +%s) - started )) --junit "$OUT/junit.xml" \
    --summary "$OUT/quick-summary.json" --gpu "$OUT/gpu.txt" --out "$OUT/last-run.json"
fi
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
