#!/usr/bin/env bash
# Builds everything the H200 device run (hack/h200/run.sh, tests/hardware/test_hw_pod.py)
# needs that the GPU host lacks, and puts it, compressed, in .h200/ at the repository root
# (ignored by git; named in the device tool's `carry`). The device tool carries at most
# 64 MiB per call, so:
#   * kube: ONE multi-call binary (hack/h200/kube) for kube-apiserver, kube-controller-manager,
#     kube-scheduler, kubelet and etcd (the etcd server version k8s.io/kubernetes requires);
#   * containerd-ctr: one multi-call binary (hack/h200/containerd) for containerd and ctr;
#   * containerd-shim-runc-v2: upstream, as hack/node builds it;
#   * runc: static, with seccomp from Debian's libseccomp.a (hack/h200/runc), so no shared
#     library has to match the host (containerd gives every pod sandbox a seccomp profile);
#   * all of them CGO_ENABLED=0 (runc: cgo, static), -trimpath -ldflags "-s -w", then xz -9e;
#   * from Debian (apt-get download, unpacked here, never installed): the CNI plugins bridge,
#     host-local and loopback, catatonit (pause image), busybox and glibc (test image), and
#     fallbacks for tools the host may lack (iproute2's ip with its libraries, openssl);
#   * cuda-probe (hack/h200/cuda-probe.c) for the test image;
#   * with H200_FOR=bench, instead of containerd, its shim and runc: kubelet-client
#     (benchmarks/kubeletclient, CGO_ENABLED=0, -s -w: 3.6 MB xz where hack/bench/build.sh's
#     unstripped one is 7.7 MB) and dra-example-driver's plugin (stripped, 9.8 MB xz), and
#     NVIDIA's gpu-kubelet-plugin (hack/bench/nvidia-driver.sh's build, -s -w), so that
#     benchmarks can run there too (run.sh's H200_BENCH);
#   * the Python packages the driver and the harness need beyond the host's Python 3.12,
#     installed here from cp312 wheels into one folder and xz-compressed (site.tar.xz: half
#     the size of the wheels, which are zip files).
# Built files are cached in ~/.cache/gpu-dra-driver/h200/{bin,py}-<versions>-<hash of the
# inputs>; a second run with the same inputs only re-assembles .h200/. Prints the sizes and
# the total that a device call would carry, and fails if that is over 64 MiB.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
k8s_version=v1.37.2
containerd_version=v2.4.2
runc_version=v1.5.2
debs=(containernetworking-plugins catatonit busybox-static libc6 libgcc-s1 libstdc++6
      iproute2 libbpf1 libelf1 libmnl0 libbsd0 libcap2 zlib1g libmd0 openssl)
# name==version as in the project's own .venv (tested there), for CPython 3.12 on x86-64.
# The driver (h11 and h2 for the API server, h11 for the probes), the harness (the kubernetes client) and
# the benchmarks (aiohttp as a client) import these;
# the host has protobuf, PyYAML, requests and certifi in versions that do. nvidia-ml-py is
# carried too: the host's pynvml (a torch environment's) imports 16 MiB of RSS where ours
# takes 3, and the memory benchmarks must see the image's.
wheels=(grpcio==1.85.3 kubernetes==37.0.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing-extensions==4.16.0 durationpy==0.11 oauthlib==4.0.1
        requests-oauthlib==2.0.0 websocket-client==1.9.2 structlog==26.1.0 urllib3==2.8.0
        python-dateutil==4.0.0 idna==3.20 click==8.5.1 aiohttp==3.14.5 aiohappyeyeballs==2.7.1
        aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
        nvidia-ml-py==13.615.71 h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0)
cache_root=${DRA_H200_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/h200}
recipe="kube $k8s_version; containerd $containerd_version; runc $runc_version seccomp static; -trimpath -s -w; xz -9e; debs ${debs[*]}"
key=$( (echo "$recipe"; cat "$here"/kube/go.mod "$here"/kube/go.sum "$here"/kube/main.go \
        "$here"/containerd/go.mod "$here"/containerd/go.sum "$here"/containerd/main.go \
        "$here"/runc/go.mod "$here"/runc/go.sum "$here"/cuda-probe.c) | sha256sum | cut -c1-12)
bin="$cache_root/bin-$k8s_version-$containerd_version-$runc_version-$key"
pykey=$(echo "cp312 manylinux x86_64: ${wheels[*]}" | sha256sum | cut -c1-12)
pybin="$cache_root/py-$pykey"
carry="$repo/.h200"
limit=$((64 * 1024 * 1024))
PY_SPY_VERSION=0.4.3  # benchmarks --profile's sampler (H200_FOR=bench)

log() { printf '[h200-build %4ds] %s\n' "$SECONDS" "$*" >&2; }

build() {
  local tmp=$1
  mkdir -p "$tmp/bin" "$tmp/debs" "$tmp/root"
  export GOTOOLCHAIN=local
  local ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=37"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  log "kube multi-call binary (cold: tens of minutes on 2 cores; mostly cached after hack/cluster and hack/node)"
  (cd "$here/kube" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "$ldflags" -o "$tmp/bin/kube" .)
  log "containerd + ctr multi-call binary"
  (cd "$here/containerd" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version" \
    -o "$tmp/bin/containerd-ctr" .)
  log "containerd-shim-runc-v2 (upstream)"
  (cd "$tmp" && CGO_ENABLED=0 GOFLAGS= GOBIN="$tmp/bin" go install -trimpath \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version")
  log "runc $runc_version, static, with seccomp"
  mkdir -p "$tmp/seccomp"
  (cd "$tmp/seccomp" && apt-get download -q libseccomp-dev >&2 && dpkg-deb -x libseccomp-dev_*.deb .)
  (cd "$here/runc" && CGO_ENABLED=1 GOFLAGS=-mod=mod PKG_CONFIG_SYSROOT_DIR="$tmp/seccomp" \
    PKG_CONFIG_PATH="$tmp/seccomp/usr/lib/x86_64-linux-gnu/pkgconfig" PKG_CONFIG_LIBDIR= \
    go build -trimpath -tags "seccomp netgo osusergo" \
    -ldflags "-s -w -X main.version=${runc_version#v} -extldflags -static" \
    -o "$tmp/bin/runc" github.com/opencontainers/runc)
  log "cuda-probe"
  gcc -O2 -Wall -o "$tmp/bin/cuda-probe" "$here/cuda-probe.c" -ldl -lm
  log "Debian packages: ${debs[*]}"
  (cd "$tmp/debs" && apt-get download -q "${debs[@]}" >&2)
  for d in "$tmp"/debs/*.deb; do dpkg-deb -x "$d" "$tmp/root"; done
  "$tmp/bin/kube" kube-apiserver --version >&2
  "$tmp/bin/kube" etcd --version | sed -n 1p >&2
  "$tmp/bin/containerd-ctr" containerd --version >&2
  "$tmp/bin/runc" --version | sed -n 1p >&2

  log "compressing (xz -9e)"
  mkdir -p "$tmp/carry"
  for b in kube containerd-ctr containerd-shim-runc-v2 runc; do
    xz -9e -T2 -c "$tmp/bin/$b" > "$tmp/carry/$b.xz" &
  done
  # Small files, one archive: where run.sh finds them (see its layout comment).
  local r="$tmp/root" s="$tmp/small"
  mkdir -p "$s/cni" "$s/tools/lib" "$s/image/lib/x86_64-linux-gnu" "$s/image/bin"
  cp "$r"/usr/lib/cni/{bridge,host-local,loopback} "$s/cni/"
  cp "$r"/usr/bin/catatonit "$s/tools/"
  cp "$r"/bin/busybox "$s/image/bin/busybox"
  cp "$tmp/bin/cuda-probe" "$s/image/bin/cuda-probe"
  local gnu="$r/lib/x86_64-linux-gnu" usrgnu="$r/usr/lib/x86_64-linux-gnu"
  for f in ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libgcc_s.so.1; do
    cp -L "$gnu/$f" "$s/image/lib/x86_64-linux-gnu/$f"
  done
  cp -L "$usrgnu/libstdc++.so.6" "$s/image/lib/x86_64-linux-gnu/"
  cp "$r"/bin/ip "$s/tools/ip" 2>/dev/null || cp "$r"/sbin/ip "$s/tools/ip"
  cp "$r"/usr/bin/openssl "$s/tools/openssl"
  for f in libbpf.so.1 libelf.so.1 libmnl.so.0 libbsd.so.0 libcap.so.2 libz.so.1 libmd.so.0; do
    cp -L "$(ls "$gnu/$f" "$usrgnu/$f" 2>/dev/null | sed -n 1p)" "$s/tools/lib/$f"
  done
  tar -C "$s" -cf - . | xz -9e -c > "$tmp/carry/small.tar.xz"
  wait
  (cd "$tmp/bin" && ls -l) >&2
}

python_site() {
  local tmp=$1
  log "Python packages for CPython 3.12: ${wheels[*]}"
  local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$tmp/whl" "${wheels[@]}" >&2
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --target "$tmp/site" "$tmp"/whl/*.whl >&2
  mkdir -p "$tmp/carry"
  tar -C "$tmp/site" -cf - . | xz -9e -c > "$tmp/carry/site.tar.xz"
}

# cached NAME DIR FUNCTION: run FUNCTION into DIR.tmp, then move it to DIR, unless DIR is complete.
cached() {
  local name=$1 dir=$2 fn=$3
  if [ -f "$dir/.complete" ]; then log "$name: cached in $dir"; return; fi
  local tmp="$dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  log "$name: building into $dir"
  "$fn" "$tmp"
  touch "$tmp/.complete"
  rm -rf "$dir"; mv "$tmp" "$dir"
  trap - EXIT
}
cached binaries "$bin" build
cached python "$pybin" python_site

# .h200/ is ignored through .git/info/exclude (not .gitignore: nothing to commit about it).
exclude="$(git -C "$repo" rev-parse --git-path info/exclude)"
case "$exclude" in /*) ;; *) exclude="$repo/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qx '/.h200/' "$exclude" 2>/dev/null || echo '/.h200/' >> "$exclude"
rm -rf "$carry"; mkdir -p "$carry"
cp -r "$bin"/carry/. "$pybin"/carry/. "$carry/"
# H200_FOR=pod (the default): what the pod test needs. H200_FOR=bench: what benchmarks need
# there instead (run.sh's H200_BENCH): no containerd, shim or runc, but kubelet-client and
# dra-example-driver's kubelet plugin (hack/bench/example-driver.sh's build, stripped) and
# NVIDIA's (hack/bench/nvidia-driver.sh's, built stripped), so that
# `benchmarks.prepare --example --nvidia` runs on the 16-core host; both do not fit in one call.
if [ "${H200_FOR:-pod}" = bench ]; then
  rm -f "$carry"/{containerd-ctr,containerd-shim-runc-v2,runc}.xz
  (cd "$repo/benchmarks/kubeletclient" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false \
    go build -trimpath -ldflags "-s -w" -o "$carry/kubelet-client" .)
  example=$(bash "$repo/hack/bench/example-driver.sh" | tail -n 1)
  strip -o "$carry/dra-example-kubeletplugin" "$example"
  nvidia=$(bash "$repo/hack/bench/nvidia-driver.sh" | tail -n 1)
  cp "$nvidia" "$carry/gpu-kubelet-plugin"
  # py-spy, the sampler of the benchmarks' --profile (benchmarks.plugin_profile): its one binary.
  spy="$cache_root/py-spy-$PY_SPY_VERSION"
  if [ ! -x "$spy/py-spy" ]; then
    rm -rf "$spy.tmp"; mkdir -p "$spy.tmp"
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
      -d "$spy.tmp" "py-spy==$PY_SPY_VERSION" >&2
    python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
      "$spy.tmp"/py_spy-*.whl "py_spy-$PY_SPY_VERSION.data/scripts/py-spy" > "$spy.tmp/py-spy"
    chmod 755 "$spy.tmp/py-spy"; rm -rf "$spy"; mv "$spy.tmp" "$spy"
  fi
  cp "$spy/py-spy" "$carry/py-spy"
  xz -9e -T2 "$carry/kubelet-client" "$carry/dra-example-kubeletplugin" "$carry/gpu-kubelet-plugin" "$carry/py-spy"
  # With NVIDIA's plugin the carry passes 64 MiB: the benchmarks need neither the test image
  # and CNI plugins of small.tar.xz nor aiohttp and its packages (benchmarks.probe_flood alone
  # imports it; H200_BENCH_AIOHTTP=1 keeps them, and then something else must go).
  tar -C "$bin/small" -cf - tools | xz -9e -T2 -c > "$carry/small.tar.xz"
  if [ -z "${H200_BENCH_AIOHTTP:-}" ]; then
    tar -C "$pybin/site" --exclude='aiohttp*' --exclude='aiohappyeyeballs*' --exclude='aiosignal*' \
      --exclude='frozenlist*' --exclude='multidict*' --exclude='propcache*' --exclude='yarl*' -cf - . \
      | xz -9e -T2 -c > "$carry/site.tar.xz"
  fi
fi

# What one device call carries: tracked files, untracked files git does not ignore, .h200/.
# (a tracked file moved out of the tree for the call, as results folders may be, counts nothing)
tree=$(cd "$repo" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
       | { xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{s+=$1} END {print s+0}')
ours=$(du -sb "$carry" | cut -f1)
(cd "$carry" && ls -l | sed 's/^/  /') >&2
log "carry: .h200 $ours bytes + working tree $tree bytes = $((ours + tree)) of $limit"
if [ $((ours + tree)) -gt $limit ]; then
  log "over the device tool's 64 MiB per call"
  exit 1
fi
echo "$carry"
