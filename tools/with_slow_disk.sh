#!/usr/bin/env bash
# Run a command with reads from the disk under a folder capped at MBPS megabytes/s, to measure
# cold reads as on a slower disk than this machine's (bundle I/O trades decoding time for
# fewer bytes read; how that pays depends on the disk). Needs root and a cgroup v1 blkio or v2
# io controller; readahead and page-cache misses of the command and its children are throttled.
#   sudo tools/with_slow_disk.sh 400 /tmp -- .venv/bin/python tools/bench_bundle.py --cases "bfloat16 kv-mix"
set -euo pipefail
if [[ $# -lt 4 || $3 != "--" ]]; then
    echo "usage: $0 MBPS FOLDER -- COMMAND [ARGS...]" >&2
    exit 2
fi
mbps=$1 folder=$2
shift 3
[[ $mbps =~ ^[0-9]+$ && $mbps -gt 0 ]] || { echo "$0: MBPS must be a positive integer, not '$mbps'" >&2; exit 2; }
source=$(df --output=source "$folder" | tail -1)
device=$(lsblk -no MAJ:MIN "$source" 2>/dev/null | head -1 | tr -d ' ') || true
[[ -n $device ]] || device=$(stat -c '%t:%T' "$source" | awk -F: '{printf "%d:%d", strtonum("0x"$1), strtonum("0x"$2)}')
bytes=$((mbps * 1000 * 1000))
if [[ -d /sys/fs/cgroup/blkio ]]; then
    group=/sys/fs/cgroup/blkio/tracekit-slow-disk-$$
    mkdir "$group"
    echo "$device $bytes" > "$group/blkio.throttle.read_bps_device"
    tasks=$group/tasks
elif grep -qw io /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    group=/sys/fs/cgroup/tracekit-slow-disk-$$
    mkdir "$group"
    echo "$device rbps=$bytes" > "$group/io.max"
    tasks=$group/cgroup.procs
else
    echo "$0: no cgroup blkio (v1) or io (v2) controller here; cannot throttle the disk" >&2
    exit 2
fi
trap 'rmdir "$group" 2>/dev/null || true' EXIT
echo "reads from $source ($device) capped at $mbps MB/s" >&2
bash -c 'echo $$ > "$1"; shift; exec "$@"' throttled "$tasks" "$@"
