#!/bin/bash
# Run a command under a memory cap (cgroup v1 memory controller), so an overrun kills that run, not
# the machine:  research/capped.sh 20G diffrlhf train model.name=sd15-random ...
# Writes the cgroup's peak use to stderr at the end. Needs a writable /sys/fs/cgroup/memory.
set -euo pipefail
limit=$1; shift
cg=/sys/fs/cgroup/memory/diffrlhf-capped-$$
mkdir -p "$cg"
echo "$limit" > "$cg/memory.limit_in_bytes"
echo $$ > "$cg/cgroup.procs"
set +e
"$@"
rc=$?
echo "[capped] peak memory of the run: $(( $(cat "$cg/memory.max_usage_in_bytes") / 1048576 )) MiB (cap $limit), exit $rc" >&2
exit $rc
