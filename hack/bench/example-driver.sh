#!/usr/bin/env bash
# Builds dra-example-driver's kubelet plugin (cmd/dra-example-kubeletplugin) from the Go
# module proxy at a pinned version, for benchmarks.prepare's side-by-side run, into a cache
# outside the repository keyed by the version and `go version`; a second run is a no-op.
# The proxy serves the pinned version but not the module's version list (`@latest` answers
# 403 "This module version is not available"), so the version is always named: $1, else
# $DRA_EXAMPLE_DRIVER_VERSION, else the default below. The module's own go.mod and go.sum
# are used unchanged. Prints the path of the binary last.
set -euo pipefail

version=${1:-${DRA_EXAMPLE_DRIVER_VERSION:-v0.2.0}}
module=sigs.k8s.io/dra-example-driver
cache_root=${DRA_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
key=$(go version | sha256sum | cut -c1-12)
dir="$cache_root/dra-example-driver-$version/$key"
bin="$dir/dra-example-kubeletplugin"

if [ -x "$bin" ]; then
  echo "dra-example-kubeletplugin $version: cached in $dir" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[example-driver %4ds] %s\n' "$SECONDS" "$*" >&2; }

# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"

log "downloading $module@$version from the Go module proxy"
src=$(go mod download -json "$module@$version" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
[ -f "$src/go.mod" ] || { log "the Go module proxy did not serve $module@$version"; exit 1; }

mkdir -p "$dir"
work=$(mktemp -d)
tmp="$bin.tmp.$$"
trap 'rm -rf "$work" "$tmp"' EXIT
cp -r "$src/." "$work/"
chmod -R u+w "$work"
log "building dra-example-kubeletplugin $version into $dir (cold Go build cache: minutes on 2 cores)"
(cd "$work" && GOFLAGS="$GOFLAGS -mod=mod" go build -v -trimpath -o "$tmp" ./cmd/dra-example-kubeletplugin 2>&1) \
  | go_progress dra-example-kubeletplugin 50
[ -x "$tmp" ] || { log "dra-example-kubeletplugin build failed"; exit 1; }
mv -f "$tmp" "$bin"
trap 'rm -rf "$work"' EXIT
log "done"
echo "$bin"
