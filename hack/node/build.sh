#!/usr/bin/env bash
# Builds what a real test node runs, into a cache outside the repository: the kubelet
# (k8s.io/kubernetes, same version and staging replaces as hack/cluster, module
# hack/node/kubelet) and containerd with its runc shim and `ctr`. Keyed like the control
# plane: the versions and a hash of the module files; a second run with the same inputs
# is a no-op. Installs nothing on the host (hack/node/setup.sh installs the Debian
# packages). Prints the binary directory last.
set -euo pipefail
#   hack/node/build.sh [VERSION]     (or DRA_K8S_VERSION=VERSION; default v1.37.2)
# Another version than the default builds its kubelet from a module generated in the cache
# (lib.sh k8s_generate_module), as hack/cluster/build.sh does for its control plane.

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"
DEFAULT_K8S_VERSION=$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/../cluster/go.mod")
k8s_version=$(k8s_version_arg "${1:-}")
containerd_version=v2.4.2
cache_root=${DRA_NODE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/node}
recipe="kubelet $k8s_version; containerd $containerd_version; CGO_ENABLED=0 -trimpath -s -w"
if [ "$k8s_version" = "$DEFAULT_K8S_VERSION" ]; then
  module_dir=$here/kubelet
  key=$( (echo "$recipe"; cat "$here"/kubelet/go.mod "$here"/kubelet/go.sum "$here"/kubelet/tools/*.go) | sha256sum | cut -c1-12)
  # The kubelet must be the control plane's version: one k8s.io/kubernetes for both modules.
  have=$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/kubelet/go.mod")
  if [ "$have" != "$k8s_version" ]; then
    echo "hack/node/kubelet/go.mod has k8s.io/kubernetes $have, hack/cluster $k8s_version: align them" >&2
    exit 1
  fi
else
  module_dir="$cache_root/src-$k8s_version"
  key=$( (echo "$recipe"; declare -f k8s_generate_module; cat "$here"/kubelet/tools/*.go) | sha256sum | cut -c1-12)
fi
bin="$cache_root/$k8s_version-$containerd_version-$key"

if [ -f "$bin/.complete" ]; then
  echo "node binaries $k8s_version / containerd $containerd_version: cached in $bin" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[node-build %s %4ds] %s\n' "$k8s_version" "$SECONDS" "$*" >&2; }

tmp="$bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

export CGO_ENABLED=0 GOTOOLCHAIN=local
if [ "$module_dir" != "$here/kubelet" ]; then
  log "generating the Go module for k8s.io/kubernetes $k8s_version in $module_dir"
  k8s_generate_module "$k8s_version" "$module_dir" "$here/kubelet/tools/tools.go"
fi
log "building kubelet $k8s_version into $bin (cold: about 4 minutes on 2 cores; less after the control plane)"
(cd "$module_dir" && GOFLAGS=-mod=mod go build -v -trimpath -ldflags "$ldflags" -o "$tmp/kubelet" \
  k8s.io/kubernetes/cmd/kubelet 2>&1) | go_progress kubelet 200
[ -x "$tmp/kubelet" ] || { log "kubelet build failed"; exit 1; }

# Containerd does not depend on the Kubernetes version: take it from another version's
# complete build of the same containerd when there is one.
# (A loop, not `ls | while`: under pipefail that pipeline fails, and set -e ends the build,
# whenever no complete build exists, as on a cold machine where only this build's own
# temporary directory matches.)
have_cd=
for d in "$cache_root"/*-"$containerd_version"-*/; do
  if [ -f "$d/.complete" ]; then have_cd=$d; break; fi
done
if [ -n "$have_cd" ]; then
  log "containerd $containerd_version: copied from $have_cd"
  cp "$have_cd"/containerd "$have_cd"/containerd-shim-runc-v2 "$have_cd"/ctr "$tmp/"
else
log "building containerd $containerd_version, containerd-shim-runc-v2, ctr (cold: about 2 minutes)"
cd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
(cd "$tmp" && GOFLAGS= GOBIN="$tmp" go install -v -trimpath -ldflags "$cd_ldflags" \
  "github.com/containerd/containerd/v2/cmd/containerd@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/ctr@$containerd_version" 2>&1) | go_progress containerd 200
fi
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
