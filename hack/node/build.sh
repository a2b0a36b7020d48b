#!/usr/bin/env bash
# Builds what a real test node runs, into a cache outside the repository: the kubelet
# (k8s.io/kubernetes, same version and staging replaces as hack/cluster, module
# hack/node/kubelet) and containerd with its runc shim and `ctr`. Keyed like the control
# plane: the versions and a hash of the module files; a second run with the same inputs
# is a no-op. Installs nothing on the host (hack/node/setup.sh installs the Debian
# packages). Prints the binary directory last.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
k8s_version=v1.37.2
containerd_version=v2.4.2
cache_root=${DRA_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/node}
recipe="kubelet $k8s_version; containerd $containerd_version; CGO_ENABLED=0 -trimpath -s -w"
key=$( (echo "$recipe"; cat "$here"/kubelet/go.mod "$here"/kubelet/go.sum "$here"/kubelet/tools/*.go) | sha256sum | cut -c1-12)
bin="$cache_root/$k8s_version-$containerd_version-$key"

# The kubelet must be the control plane's version: one k8s.io/kubernetes for both modules.
want=$(grep -E '^\s*k8s.io/kubernetes v' "$here/../cluster/go.mod" | awk '{print $2}')
have=$(grep -E '^\s*k8s.io/kubernetes v' "$here/kubelet/go.mod" | awk '{print $2}')
if [ "$want" != "$have" ] || [ "$have" != "$k8s_version" ]; then
  echo "hack/node/kubelet/go.mod has k8s.io/kubernetes $have, hack/cluster $want, this script $k8s_version: align them" >&2
  exit 1
fi

if [ -f "$bin/.complete" ]; then
  echo "node binaries $k8s_version / containerd $containerd_version: cached in $bin" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[node-build %4ds] %s\n' "$SECONDS" "$*" >&2; }

# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"

tmp="$bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=37"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

export CGO_ENABLED=0 GOTOOLCHAIN=local
log "building kubelet $k8s_version into $bin (cold: about 4 minutes on 2 cores; less after the control plane)"
(cd "$here/kubelet" && GOFLAGS=-mod=mod go build -v -trimpath -ldflags "$ldflags" -o "$tmp/kubelet" \
  k8s.io/kubernetes/cmd/kubelet 2>&1) | go_progress kubelet 200
[ -x "$tmp/kubelet" ] || { log "kubelet build failed"; exit 1; }

log "building containerd $containerd_version, containerd-shim-runc-v2, ctr (cold: about 2 minutes)"
cd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
(cd "$tmp" && GOFLAGS= GOBIN="$tmp" go install -v -trimpath -ldflags "$cd_ldflags" \
  "github.com/containerd/containerd/v2/cmd/containerd@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/ctr@$containerd_version" 2>&1) | go_progress containerd 200
for b in containerd containerd-shim-runc-v2 ctr; do
  [ -x "$tmp/$b" ] || { log "$b build failed"; exit 1; }
done

"$tmp/kubelet" --version >&2
"$tmp/containerd" --version >&2
touch "$tmp/.complete"
rm -rf "$bin"; mv "$tmp" "$bin"
trap - EXIT
log "done"
echo "$bin"
