#!/usr/bin/env bash
# Several `tools/gpu_run.sh` runs at once on the GPU machine ("lanes"), each with its own release,
# -k expression, results, temporary folder and vLLM cache (TRACEKIT_GPU_LANE): the tiny engines
# leave the GPU mostly idle and take a few GiB each, so one device call does the work of several.
# The kits must be stashed already (tools/gpu_run.sh says how); each kit's `env` step runs once
# here before the lanes share it. Everything the lanes wrote comes back as three archives ($OUT
# takes at most 8 files): lanes.tgz (logs, junit, replay records, quick runs' last-run.json),
# across.tgz (the steps left for replays across releases), bundles.tgz (bundles not reproduced).
#
#   bash tools/gpu_lanes.sh SECONDS COMMIT 'NAME|RELEASE|quick or run|K-EXPRESSION[|AFTER]' ...
#
# SECONDS: every lane ends by then (from this script's start), a lane that waited included, so that
# the call ends with the archives made. COMMIT: the full hash of HEAD (the GPU has no .git), for the
# quick lanes' last-run.json.
# AFTER: the name of another lane this one waits for, and whose steps left for replays across
# releases it replays (TRACEKIT_GPU_ACROSS_RELEASES_FROM): 0.34's drafted steps under 0.26 in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:?seconds the lanes may take} commit=${2:?commit}
shift 2
back=${OUT:?the device call\'s OUT} results=/tmp/tracekit-lanes
rm -rf $results && mkdir -p $results
for release in $(printf '%s\n' "$@" | cut -d'|' -f2 | sort -u); do
  case $release in
    0.26) kit=.gpu-kit ;;
    0.34) kit=.gpu-kit34 ;;
    *) echo "gpu_lanes.sh: a lane's release is 0.26 or 0.34, not '$release'" >&2; exit 2 ;;
  esac
  (source $kit/install.sh env) > $results/env-$release.log 2>&1 || { echo "the $release kit's env step failed:"; tail -5 $results/env-$release.log; }
done
touch $results/lanes.txt
deadline=$(( $(date +%s) + seconds ))
for lane in "$@"; do
  IFS='|' read -r name release mode expression after <<< "$lane"
  quick=()
  [ "$mode" = quick ] && quick=(--quick "$commit")
  (if [ -n "$after" ]; then
     until grep -q "^lane $after " $results/lanes.txt || [ "$(date +%s)" -ge $deadline ]; do sleep 5; done
     export TRACEKIT_GPU_ACROSS_RELEASES_FROM=/tmp/tracekit-gpu-across-$after
   fi
   left=$(( deadline - $(date +%s) ))  # (timeout 0 would mean none)
   TRACEKIT_GPU_LANE=$name OUT=$results timeout $(( left > 1 ? left : 1 )) bash tools/gpu_run.sh --vllm "$release" "${quick[@]}" \
     -k "$expression" > $results/lane-$name.log 2>&1
   echo "lane $name ($release, $mode): rc $?" >> $results/lanes.txt) &
done
sleep 60 && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | sed 's/^/GPU memory a minute in: /' &
wait
cat $results/lanes.txt
for log in $results/lane-*.log; do
  echo "== ${log##*/}"
  grep -E " (PASSED|FAILED|ERROR)( |$)" "$log" | sed 's/.*:://' | cut -c1-150
  tail -1 "$log"
done
tar czf "$back/lanes.tgz" -C $results --exclude=bundles --exclude=across-releases .
(cd $results && tar czf "$back/across.tgz" $(find . -path "*across-releases*" -name "*.zst") 2>/dev/null)
(cd $results && tar czf "$back/bundles.tgz" $(find . -path "*/bundles/*" -name "*.zst") 2>/dev/null)
ls -la "$back"
