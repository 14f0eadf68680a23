#!/bin/sh
# A process that dies mid-training: the others must end with an error, not hang.
#
#   tests/dist/fault.sh MPIEXEC GPT_DDP DATA
#
# Process 1 of 2 kills itself (SIGKILL) at step 3 while process 0 waits in an
# allreduce for it; mpirun must notice and end the job with a nonzero status
# well within the limit. (mpirun's own status is 137 here, the dead
# process's signal, so the clock tells a hang from it, not the status.)
set -u
mpiexec=$1
prog=$2
data=$3
limit=60
start=$(date +%s)
out=$(timeout -k 5 "$limit" "$mpiexec" --oversubscribe -np 2 "$prog" --steps 50 --die-at 3 --data "$data" 2>&1)
rc=$?
took=$(($(date +%s) - start))
echo "$out" | tail -n 20
if [ "$took" -ge "$limit" ]; then
  echo "FAIL: still running after ${limit}s: a dead process hung the others"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "FAIL: the job ended with status 0 though a process died"
  exit 1
fi
echo "ok: the job ended with status $rc after ${took}s"
