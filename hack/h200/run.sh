#!/usr/bin/env bash
# Runs the pod test of issue 17 (tests/hardware/test_hw_pod.py) on the GPU host, from what
# hack/h200/build.sh put in .h200/. The one command of a device call, from the repo root:
#
#     bash hack/h200/run.sh            (device tool: carry [".h200"])
#
# Rehearsal on a machine without a GPU (simulated GPU, a stand-in driver root whose
# nvidia-smi is a script; the assertions about what the GPU answers fail there):
#
#     H200_SIMULATE=h200-single H200_PYTHON=.venv/bin/python H200_NO_WHEELS=1 bash hack/h200/run.sh
#
# It unpacks into $H200_WORK (default /tmp/h200), takes the host's ip and openssl where
# it has them and the carried ones where not, checks what the kernel offers (veth, bridge,
# overlayfs) and tells the harness, then runs pytest. What comes back: $OUT (the device
# tool's folder; $H200_WORK/out elsewhere) gets host.txt (facts and checks), pytest.log,
# results.md (every recorded command and output) and logs.tar.gz (control plane, kubelet,
# containerd and driver logs, configs). It writes nothing outside $H200_WORK, /tmp/dra-*
# and $OUT, and leaves no process behind (the harness stops what it starts, by PID).
set -uo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
carry=${H200_CARRY:-$repo/.h200}
work=${H200_WORK:-/tmp/h200}
out=${OUT:-$work/out}
py=${H200_PYTHON:-python3}
t0=$SECONDS
log() { printf '[h200-run %4ds] %s\n' "$((SECONDS - t0))" "$*" >&2; }

[ -f "$carry/kube.xz" ] || { log "no $carry/kube.xz: run hack/h200/build.sh first (and carry .h200)"; exit 2; }
rm -rf "$work"
mkdir -p "$work"/{libexec,cluster-bin,node-bin,small,path,results} "$out"

log "unpacking $(du -sh "$carry" | cut -f1) from $carry"
for b in kube containerd-ctr containerd-shim-runc-v2 runc kubelet-client dra-example-kubeletplugin \
         gpu-kubelet-plugin py-spy; do
  [ -f "$carry/$b.xz" ] || continue  # H200_FOR=pod carries the node's, H200_FOR=bench the benchmarks'
  (xz -dc "$carry/$b.xz" > "$work/libexec/$b" && chmod 755 "$work/libexec/$b") &
done
tar -xJf "$carry/small.tar.xz" -C "$work/small"
wait
# Multi-call binaries choose their program by the name they are started as.
for c in etcd kube-apiserver kube-controller-manager kube-scheduler; do ln "$work/libexec/kube" "$work/cluster-bin/$c"; done
ln "$work/libexec/kube" "$work/node-bin/kubelet"
ln "$work/libexec/containerd-ctr" "$work/node-bin/containerd"
ln "$work/libexec/containerd-ctr" "$work/node-bin/ctr"
ln "$work/libexec/containerd-shim-runc-v2" "$work/node-bin/containerd-shim-runc-v2"

# Tools the harness runs that a host may lack: the carried Debian builds, through wrappers.
tools="$work/small/tools"
for t in ip openssl; do
  if ! command -v "$t" >/dev/null; then
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$tools/lib" "$tools/$t" > "$work/path/$t"
    chmod 755 "$work/path/$t"
    log "host has no $t: using the carried one"
  fi
done
export PATH="$PATH:$work/path"

if [ -f "$carry/site.tar.xz" ] && [ -z "${H200_NO_WHEELS:-}" ]; then
  mkdir -p "$work/site"
  tar -xJf "$carry/site.tar.xz" -C "$work/site" || { log "cannot unpack the Python packages"; exit 2; }
  export PYTHONPATH="$work/site:$repo"
else
  export PYTHONPATH="$repo"
fi
# Byte-compiled once, as pip does in the image: the host sets PYTHONDONTWRITEBYTECODE, and
# without this every plugin start compiles grpc, h11 and the driver again (0.68 s of CPU
# to registered where the image takes 0.24, and the compiler's garbage in the RSS).
"$py" -m compileall -q -j 0 "$repo/dra_driver" "$repo/controller" ${PYTHONPATH%%:*} >/dev/null 2>&1 \
  || log "byte-compiling failed; starts will compile at import"

# ---------------------------------------------------------------- what this host offers
check() {  # check NAME COMMAND...: prints "NAME: ok" or "NAME: FAILED <output>"; returns its status
  local name=$1; shift
  local output
  if output=$("$@" 2>&1); then echo "$name: ok"; return 0; fi
  echo "$name: FAILED $(echo "$output" | tr '\n' ' ' | cut -c1-300)"; return 1
}
{
  echo "date: $(date -u +%FT%TZ)"
  echo "uname: $(uname -a)"
  echo "os: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}")"
  echo "python: $(command -v "$py") $("$py" --version 2>&1)"
  echo "cpus: $(nproc)  memory: $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
  echo "cgroup: $(stat -fc %T /sys/fs/cgroup) $(cat /proc/self/cgroup | tr '\n' ' ')"
  echo "cgroup controllers: $(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null)"
  for t in ip openssl iptables setpriv nsenter unshare mount nvidia-smi; do echo "tool $t: $(command -v $t || echo MISSING)"; done
  echo "libseccomp: $(ldconfig -p 2>/dev/null | grep -c libseccomp.so.2) entries in ld.so.cache"
  echo "nvidia-smi -L: $(nvidia-smi -L 2>&1)"
  echo "nvidia-smi: $(nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version --format=csv,noheader 2>&1)"
  echo "driver root /usr/local/nvidia: $(ls /usr/local/nvidia 2>&1 | tr '\n' ' ')"
  echo "binaries: $(cd "$work/libexec" && ls -l | awk 'NR>1 {print $NF "=" $5}' | tr '\n' ' ')"
  "$work/libexec/kube" kube-apiserver --version 2>&1
  "$work/libexec/containerd-ctr" containerd --version 2>&1
  "$work/libexec/runc" --version 2>&1 | sed -n 1p
} > "$out/host.txt" 2>&1
probe="h200p$$"
if check "veth" ip link add "${probe}a" type veth peer name "${probe}b" >> "$out/host.txt"; then
  ip link del "${probe}a" 2>/dev/null
else
  export DRA_NODE_IP_ON_LO=1
fi
if check "bridge" ip link add "${probe}br" type bridge >> "$out/host.txt"; then
  ip link del "${probe}br" 2>/dev/null
else
  export H200_HOST_NETWORK=1  # no CNI bridge: the test pods use the host's network
fi
ov="$work/overlay-check"
mkdir -p "$ov"/{l,u,w,m}
if check "overlayfs" mount -t overlay overlay -o "lowerdir=$ov/l,upperdir=$ov/u,workdir=$ov/w" "$ov/m" >> "$out/host.txt"; then
  umount "$ov/m"
else
  export DRA_NODE_SNAPSHOTTER=native
fi
echo "knobs: DRA_NODE_IP_ON_LO=${DRA_NODE_IP_ON_LO:-} H200_HOST_NETWORK=${H200_HOST_NETWORK:-} DRA_NODE_SNAPSHOTTER=${DRA_NODE_SNAPSHOTTER:-overlayfs}" >> "$out/host.txt"
cat "$out/host.txt" >&2

# ---------------------------------------------------------------- the test
if [ -n "${H200_SIMULATE:-}" ]; then
  # A stand-in driver root (hack/h200/standin.c: nvidia-smi and libcuda that answer by the
  # claim's UUID variable when the container has /dev/nvidia0; the harness's stand-in MPS
  # control tool), so the rehearsal runs every step; what they answer proves nothing.
  standin="$work/standin"
  mkdir -p "$standin/bin" "$standin/lib64"
  gcc -O2 -o "$standin/bin/nvidia-smi" "$repo/hack/h200/standin.c"
  gcc -O2 -shared -fPIC -DLIBCUDA -o "$standin/lib64/libcuda.so.580.159.04" "$repo/hack/h200/standin.c"
  ln -s libcuda.so.580.159.04 "$standin/lib64/libcuda.so.1"
  "$py" -c "import sys, pathlib; from tests.harness.fake_mps import install_fake_mps_control as i; i(pathlib.Path(sys.argv[1]))" "$standin"
  export HW_SIMULATE="$H200_SIMULATE" DRA_DRIVER_ROOT="$standin"
fi
[ -x "$work/libexec/kubelet-client" ] && export DRA_KUBELET_CLIENT="$work/libexec/kubelet-client"
[ -x "$work/libexec/dra-example-kubeletplugin" ] \
  && export DRA_EXAMPLE_DRIVER_BINARY="$work/libexec/dra-example-kubeletplugin"
[ -x "$work/libexec/py-spy" ] && export PY_SPY="$work/libexec/py-spy"  # benchmarks' --profile
[ -x "$work/libexec/gpu-kubelet-plugin" ] \
  && export DRA_NVIDIA_DRIVER_BINARY="$work/libexec/gpu-kubelet-plugin"
export DRA_CLUSTER_BIN="$work/cluster-bin" DRA_NODE_BIN="$work/node-bin" \
  DRA_NODE_RUNC="$work/libexec/runc" DRA_NODE_CNI_BIN="$work/small/cni" \
  DRA_CATATONIT="$tools/catatonit" DRA_BUSYBOX="$work/small/image/bin/busybox" \
  H200_IMAGE_PARTS="$work/small/image" H200_NODES_DIR="$work/nodes" DRA_NODE_KEEP=1 \
  HW_RESULTS_DIR="$work/results" PYTHONUNBUFFERED=1
# H200_TESTS picks other hardware tests, e.g. on a multi-GPU kind (issue 18):
#   H200_TESTS="tests/hardware/test_hw_multi_gpu.py tests/hardware/test_hw_discovery.py" bash hack/h200/run.sh
tests=${H200_TESTS:-tests/hardware/test_hw_pod.py}
log "pytest $tests"
# shellcheck disable=SC2086  # a list of test paths
timeout "${H200_TIMEOUT:-420}" "$py" -m pytest $tests -v -rA -s -p no:cacheprovider \
  --basetemp="$work/pytest" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
log "pytest exit status $status"

# H200_BENCH names benchmarks (python -m benchmarks.<name>) to run after the tests, on the
# same unpacked control plane binaries and kubelet-client; H200_BENCH_ARGS are passed to
# each, unless H200_BENCH_ARGS_<name> gives that one its own (issue 50's one run of both:
#   H200_BENCH="prepare node_rss" H200_BENCH_ARGS_prepare='--example --nvidia --starts 3'). Issue 26's probe flood and issue 37's comparison with dra-example-driver on the
# 16-core host (carry built by `H200_FOR=bench bash hack/h200/build.sh`):
#   H200_TESTS=tests/hardware/test_hw_discovery.py H200_BENCH=probe_flood bash hack/h200/run.sh
#   H200_TESTS=tests/hardware/test_hw_discovery.py H200_BENCH=prepare H200_BENCH_ARGS=--example \
#     bash hack/h200/run.sh
# Each one's figures (its JSON on stdout) come back as $OUT/<name>_h200.json, its progress
# and errors as $OUT/<name>.log; a failing benchmark makes the exit status non-zero.
for b in ${H200_BENCH:-}; do
  own="H200_BENCH_ARGS_$b"
  args=${!own-${H200_BENCH_ARGS:-}}
  log "benchmark $b $args"
  # shellcheck disable=SC2086  # arguments as given
  timeout "${H200_BENCH_TIMEOUT:-420}" "$py" -m "benchmarks.$b" $args \
    > "$out/${b}_h200.json" 2> "$out/$b.log"
  bench_status=$?
  log "benchmark $b exit status $bench_status; last lines of its log:"
  tail -n 5 "$out/$b.log" >&2
  [ "$status" -eq 0 ] && status=$bench_status
done

cp "$work/results/ALL.md" "$out/results.md" 2>/dev/null
# Logs and configs, not the image stores.
(cd "$work" && find nodes pytest \( -path '*/containerd/root' -o -path '*/containerd/state' \) -prune -o -type f \
   \( -name '*.log' -o -name '*.json' -o -name '*.toml' -o -name '*.conflist' -o -name '*.yaml' \) -size -20M \
   -print0 2>/dev/null \
  | tar --null -czf "$out/logs.tar.gz" -T - 2>/dev/null)
ls -l "$out" >&2
exit "$status"
