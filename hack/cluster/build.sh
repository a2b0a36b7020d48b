#!/usr/bin/env bash
# Builds the real control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) and cdicheck from Go modules into a cache outside the
# repository, keyed by the Kubernetes version and a hash of this module's files.
# A second run with the same inputs is a no-op. Prints the binary directory last.
#
#   hack/cluster/build.sh [VERSION]     (or DRA_K8S_VERSION=VERSION; default v1.37.2)
#
# The default version builds from this directory's go.mod. Another one (v1.34.4, v1.35.4,
# v1.36.3: the newest patches the Go module proxy serves) builds from a module generated
# next to its binaries in the cache (lib.sh k8s_generate_module), with the same etcd and
# cdicheck; its first build needs the Go module proxy.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"
DEFAULT_K8S_VERSION=$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/go.mod")
k8s_version=$(k8s_version_arg "${1:-}")
cache_root=${DRA_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/cluster}
if [ "$k8s_version" = "$DEFAULT_K8S_VERSION" ]; then
  module_dir=$here
  key=$(cat "$here"/go.mod "$here"/go.sum "$here"/etcd/go.mod "$here"/etcd/go.sum "$here"/cmd/*/*.go | sha256sum | cut -c1-12)
else
  module_dir="$cache_root/src-$k8s_version"
  key=$( (echo "$k8s_version"; declare -f k8s_generate_module; cat "$here"/tools/tools.go "$here"/etcd/go.mod \
    "$here"/etcd/go.sum "$here"/cmd/*/*.go) | sha256sum | cut -c1-12)
fi
bin="$cache_root/$k8s_version-$key"

if [ -f "$bin/.complete" ]; then
  echo "control plane $k8s_version: cached in $bin" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[build %s %4ds] %s\n' "$k8s_version" "$SECONDS" "$*" >&2; }

tmp="$bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

ver_pkg=k8s.io/component-base/version
client_ver_pkg=k8s.io/client-go/pkg/version
ldflags="-s -w"
for p in $ver_pkg $client_ver_pkg; do
  ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
if [ "$module_dir" != "$here" ]; then
  log "generating the Go module for k8s.io/kubernetes $k8s_version in $module_dir"
  k8s_generate_module "$k8s_version" "$module_dir" "$here/tools/tools.go"
fi
log "building Kubernetes $k8s_version control plane into $bin (cold: tens of minutes on 2 cores)"
(cd "$module_dir" && go build -v -trimpath -ldflags "$ldflags" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl 2>&1) | go_progress kubernetes 200
[ -x "$tmp/kube-apiserver" ] || { log "kubernetes build failed"; exit 1; }
# cdicheck does not depend on the Kubernetes version: built from this directory's module.
(cd "$here" && go build -trimpath -ldflags "-s -w" -o "$tmp/" ./cmd/cdicheck)

log "building etcd"
(cd "$here/etcd" && go build -v -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3 2>&1) | go_progress etcd 200
[ -x "$tmp/etcd" ] || { log "etcd build failed"; exit 1; }

"$tmp/kube-apiserver" --version >&2
"$tmp/etcd" --version >&2
touch "$tmp/.complete"
rm -rf "$bin"; mv "$tmp" "$bin"
trap - EXIT
log "done"
echo "$bin"
