#!/usr/bin/env bash
# Runs a command with its reads of the root file system's block device throttled to a slower
# flash (cgroup v1 blkio: bytes and requests per second; O_DIRECT reads included), as root:
#
#   bash bench/slow_flash.sh 200 python bench/host_tier_ab.py --tokens 2048   # an eMMC-class 200 MB/s
#
# The group is /sys/fs/cgroup/blkio/sparkv-slowflash; its limits are set on each run.
set -euo pipefail
mbps=$1; shift
grp=/sys/fs/cgroup/blkio/sparkv-slowflash
[ -w /sys/fs/cgroup/blkio ] || { echo "slow_flash: needs root and cgroup v1 blkio" >&2; exit 2; }
dev=$(lsblk -no MAJ:MIN "$(findmnt -no SOURCE /)" | tr -d ' ')
mkdir -p "$grp"
echo "$dev $((mbps * 1000000))" > "$grp/blkio.throttle.read_bps_device"
echo "$dev ${SLOW_FLASH_IOPS:-4000}" > "$grp/blkio.throttle.read_iops_device"
echo $$ > "$grp/tasks"
exec "$@"
