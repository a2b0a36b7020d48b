#!/bin/bash
# Starts nvidia-cuda-mps-control -d by hand in the settings the driver may use and says
# which start: pipe directory path length, directory mode, the private-/dev/shm wrapper,
# and the driver's minimal environment. Prints OK=<names> last. Usage: mps_diag.sh [bin dir]
B=${1:-/usr/local/nvidia/bin}
OK=()
try() { # name dir mode
  local name=$1 d=$2 mode=$3
  rm -rf "$d"; mkdir -p "$d/pipe" "$d/log" "$d/shm"; chmod "$mode" "$d/pipe" "$d/log" "$d/shm"
  env -i PATH="$B:/usr/sbin:/usr/bin:/sbin:/bin" LD_LIBRARY_PATH="${B%/bin}/lib64" \
    CUDA_MPS_PIPE_DIRECTORY="$d/pipe" CUDA_MPS_LOG_DIRECTORY="$d/log" \
    unshare --mount --propagation private -- /bin/sh -c 'mount --bind "$0" /dev/shm && exec "$@"' \
    "$d/shm" "$B/nvidia-cuda-mps-control" -d > "$d/start.out" 2>&1
  local rc=$?
  sleep 1
  echo "== $name: pipe dir $d/pipe (${#d} chars + 5), mode $mode -> exit $rc"
  cat "$d/start.out"; ls -la "$d/pipe"; tail -n 5 "$d"/log/*.log 2>/dev/null
  if [ -e "$d/pipe/control" ]; then
    OK+=("$name")
    echo get_server_list | CUDA_MPS_PIPE_DIRECTORY="$d/pipe" timeout 10 "$B/nvidia-cuda-mps-control"
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$d/pipe" timeout 10 "$B/nvidia-cuda-mps-control"; echo "quit exit $?"
    sleep 1
  fi
}
LONG=/tmp/pytest-of-root/pytest-9/test_mps_claim_limits_memory_a0/mps/5a0c1a55-0000-4000-8000-0000000003b5
try long1777 "$LONG" 1777
try short1777 /run/mpsdiag/5a0c1a55-0000-4000-8000-0000000003b5 1777
try short755 /run/mpsdiag/5a0c1a55-0000-4000-8000-0000000003b6 755
pgrep -a nvidia-cuda-mps || echo "no nvidia-cuda-mps process left"
echo "OK=${OK[*]}"
