#!/usr/bin/env bash
# Builds benchmarks/kubeletclient (kubelet-client: the kubelet's side of the DRA gRPC API
# in grpc-go, for the benchmarks) into a cache outside the repository, keyed by a hash of
# the module's files and `go version`; a second run with the same inputs is a no-op. The
# modules come from the Go module cache (or the module proxy when it is cold); go.sum is
# complete, so nothing is resolved at build time. Prints the path of the binary last.
set -euo pipefail

here=$(cd "$(dirname "$0")/../../benchmarks/kubeletclient" && pwd)
cache_root=${DRA_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/kubeletclient}
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
key=$( (cat "$here"/go.mod "$here"/go.sum "$here"/main.go; go version) | sha256sum | cut -c1-16)
bin="$cache_root/$key/kubelet-client"

if [ -x "$bin" ]; then
  echo "kubelet-client: cached in $(dirname "$bin")" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[bench-build %4ds] %s\n' "$SECONDS" "$*" >&2; }

# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"

mkdir -p "$(dirname "$bin")"
tmp="$bin.tmp.$$"
trap 'rm -f "$tmp"' EXIT

log "building kubelet-client into $(dirname "$bin") (cold Go build cache: tens of seconds on 2 cores)"
(cd "$here" && go build -v -trimpath -o "$tmp" . 2>&1) | go_progress kubelet-client 50
[ -x "$tmp" ] || { log "kubelet-client build failed"; exit 1; }
mv -f "$tmp" "$bin"
trap - EXIT
log "done"
echo "$bin"
