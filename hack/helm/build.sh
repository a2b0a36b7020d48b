#!/usr/bin/env bash
# Builds Helm v4 from the Go module proxy (`go install helm.sh/helm/v4/cmd/helm@<version>`;
# its go.mod has no replace directives) into a cache outside the repository, keyed by the
# version and the build recipe; a second run with the same inputs is a no-op. Helm is a
# test and install tool here: nothing in the driver imports or runs it. Prints the path of
# the `helm` binary last.
set -euo pipefail

helm_version=v4.3.2
cache_root=${DRA_HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/helm}
recipe="helm $helm_version; CGO_ENABLED=0 -trimpath -s -w; version stamped"
key=$(echo "$recipe" | sha256sum | cut -c1-12)
dir="$cache_root/$helm_version-$key"

if [ -f "$dir/.complete" ]; then
  echo "helm $helm_version: cached in $dir" >&2
  echo "$dir/helm"
  exit 0
fi

log() { printf '[helm-build %4ds] %s\n' "$SECONDS" "$*" >&2; }

# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"

tmp="$dir.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

log "building helm $helm_version into $dir (cold: about 3 minutes on 2 cores)"
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version"
ldflags+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
(cd "$tmp" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS= GOBIN="$tmp" go install -v -trimpath \
  -ldflags "$ldflags" "helm.sh/helm/v4/cmd/helm@$helm_version" 2>&1) | go_progress helm 100
[ -x "$tmp/helm" ] || { log "helm build failed"; exit 1; }
"$tmp/helm" version >&2
touch "$tmp/.complete"
rm -rf "$dir"; mv "$tmp" "$dir"
trap - EXIT
log "done"
echo "$dir/helm"
