#!/usr/bin/env bash
# Builds NVIDIA's GPU kubelet plugin (cmd/gpu-kubelet-plugin of sigs.k8s.io/dra-driver-nvidia-gpu)
# from the Go module proxy at a pinned version, for benchmarks.prepare's side-by-side run, into
# a cache outside the repository keyed by the version and `go version`; a second run is a no-op.
# The version is always named ($1, else $DRA_NVIDIA_DRIVER_VERSION, else the default below):
# the proxy serves pinned versions, not `@latest`. The module's own go.mod and go.sum are used
# unchanged. Unlike the example driver it needs cgo (go-nvml dlopens libnvidia-ml.so.1 at run
# time; nothing NVIDIA's is linked in), built as NVIDIA's Makefile builds it: CGO_ENABLED=1,
# CGO_LDFLAGS_ALLOW for go-nvml's --unresolved-symbols, -ldflags "-s -w" (stripped: the GPU
# host's carry is 64 MiB) with the version set in internal/info. Prints the binary's path last.
#
# Two of its requirements are not served by the proxy here (403 "This module version is not
# available"); the build then replaces them, and says so:
#   * k8s.io/kubernetes v1.37.0-rc.0 (the plugin imports only pkg/kubelet/checkpointmanager
#     from it) -> $DRA_NVIDIA_K8S_REPLACE, default v1.37.2, the release of that line;
#   * github.com/NVIDIA/go-nvfm v0.1.0 (Fabric Manager bindings, used only with the
#     FabricManagerPartitioning feature gate, off by default) -> the git checkout named by
#     $DRA_NVIDIA_GO_NVFM_SRC (its HEAD, through `git archive`; no go-nvfm commit has v0.1.0's
#     go.sum hash, so the version is not claimed), else the build stops and names the variable.
set -euo pipefail

version=${1:-${DRA_NVIDIA_DRIVER_VERSION:-v0.5.0}}
module=sigs.k8s.io/dra-driver-nvidia-gpu
cache_root=${DRA_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver}
export CGO_ENABLED=1 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
export CGO_LDFLAGS_ALLOW='-Wl,--unresolved-symbols=ignore-in-object-files'
key=$( (go version; gcc --version | sed -n 1p) | sha256sum | cut -c1-12)
dir="$cache_root/dra-driver-nvidia-gpu-$version/$key"
bin="$dir/gpu-kubelet-plugin"

if [ -x "$bin" ]; then
  echo "gpu-kubelet-plugin $version: cached in $dir" >&2
  echo "$bin"
  exit 0
fi

log() { printf '[nvidia-driver %4ds] %s\n' "$SECONDS" "$*" >&2; }

# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"

log "downloading $module@$version from the Go module proxy"
src=$(cd / && GOFLAGS=-mod=mod go mod download -json "$module@$version" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
[ -f "$src/go.mod" ] || { log "the Go module proxy did not serve $module@$version"; exit 1; }

mkdir -p "$dir"
work=$(mktemp -d)
tmp="$bin.tmp.$$"
trap 'rm -rf "$work" "$tmp"' EXIT
cp -r "$src/." "$work/"
chmod -R u+w "$work"
replaced=()
k8s_pinned=$(sed -n 's|^[[:space:]]*k8s.io/kubernetes \(v[^ ]*\).*|\1|p' "$work/go.mod")
if ! (cd / && GOFLAGS=-mod=mod go mod download "k8s.io/kubernetes@$k8s_pinned" 2>/dev/null); then
  k8s=${DRA_NVIDIA_K8S_REPLACE:-v1.37.2}
  (cd "$work" && go mod edit -replace "k8s.io/kubernetes=k8s.io/kubernetes@$k8s")
  replaced+=("k8s.io/kubernetes $k8s_pinned -> $k8s")
fi
if ! (cd / && GOFLAGS=-mod=mod go mod download github.com/NVIDIA/go-nvfm@v0.1.0 2>/dev/null); then
  nvfm=${DRA_NVIDIA_GO_NVFM_SRC:-}
  [ -n "$nvfm" ] || { log "the proxy does not serve github.com/NVIDIA/go-nvfm@v0.1.0: set DRA_NVIDIA_GO_NVFM_SRC to a git checkout of it"; exit 1; }
  mkdir "$work/.go-nvfm"
  git -C "$nvfm" archive HEAD | tar -x -C "$work/.go-nvfm"
  (cd "$work" && go mod edit -replace "github.com/NVIDIA/go-nvfm=./.go-nvfm")
  replaced+=("github.com/NVIDIA/go-nvfm v0.1.0 -> $(git -C "$nvfm" rev-parse HEAD) (git archive of $nvfm)")
fi
for r in "${replaced[@]}"; do log "replaced: $r"; done
log "building gpu-kubelet-plugin $version into $dir (cold Go build cache: many minutes on 2 cores)"
(cd "$work" && GOFLAGS="$GOFLAGS -mod=mod" go build -v -trimpath \
  -ldflags "-s -w -X $module/internal/info.version=$version" \
  -o "$tmp" ./cmd/gpu-kubelet-plugin 2>&1) | go_progress gpu-kubelet-plugin 50
[ -x "$tmp" ] || { log "gpu-kubelet-plugin build failed"; exit 1; }
mv -f "$tmp" "$bin"
printf '%s\n' "$version" "${replaced[@]}" > "$bin.replaced"
trap 'rm -rf "$work"' EXIT
log "done"
echo "$bin"
