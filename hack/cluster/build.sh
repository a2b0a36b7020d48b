#!/usr/bin/env bash
# Builds the real control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl) and cdicheck from Go modules into a cache outside the
# repository, keyed by the Kubernetes version and a hash of this module's files.
# A second run with the same inputs is a no-op. Prints the binary directory last.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
k8s_version=v1.37.2
cache_root=${DRA_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/cluster}
key=$(cat "$here"/go.mod "$here"/go.sum "$here"/etcd/go.mod "$here"/etcd/go.sum "$here"/cmd/*/*.go | sha256sum | cut -c1-12)
bin="$cache_root/$k8s_version-$key"

if [ -f "$bin/.complete" ]; then
  echo "control plane $k8s_version: cached in $bin" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[build %4ds] %s\n' "$SECONDS" "$*" >&2; }

# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"

tmp="$bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

ver_pkg=k8s.io/component-base/version
client_ver_pkg=k8s.io/client-go/pkg/version
ldflags="-s -w"
for p in $ver_pkg $client_ver_pkg; do
  ldflags+=" -X $p.gitVersion=$k8s_version -X $p.gitMajor=1 -X $p.gitMinor=37"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done

export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
log "building Kubernetes $k8s_version control plane into $bin (cold: tens of minutes on 2 cores)"
(cd "$here" && go build -v -trimpath -ldflags "$ldflags" -o "$tmp/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl \
  ./cmd/cdicheck 2>&1) | go_progress kubernetes 200
[ -x "$tmp/kube-apiserver" ] || { log "kubernetes build failed"; exit 1; }

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
