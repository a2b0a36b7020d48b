#!/usr/bin/env bash
# Builds the driver's container image from the repository's Dockerfile with buildah (the
# Debian package; no Docker engine, no registry), into a cache outside the repository, and
# writes it as an OCI archive that `ctr images import` takes, with the image's SBOM
# (CycloneDX, made in the build: see the Dockerfile) beside it. Prints the archive path last.
#
# The Dockerfile's base (docker.io/library/python:3.11-slim-bookworm) cannot be pulled here,
# so a stand-in is made once under that name: Debian bookworm (mmdebstrap, minbase) with
# python3, python3-venv and ca-certificates. Package downloads come from the Debian mirror
# and PyPI; when the host's CA bundle exists it is lent to the build (PIP_CERT), for pip
# behind a TLS-intercepting proxy.
#
# The base is pinned by digest: the build resolves the manifest digest of the base it has in
# local storage and builds FROM <base>@sha256:<digest> (PYTHON_IMAGE), so it uses exactly that
# image or fails; the digest goes into the image's labels org.opencontainers.image.base.name
# and .base.digest (PYTHON_DIGEST), into base.ref beside the archive (name@digest), and on stderr.
#
# Cache keys: the base by its recipe; the image by the recipe, the base key, the image name
# and the content of every file the build context holds. Same inputs: a no-op. Installs
# buildah, runc and mmdebstrap with apt-get when missing (root). Changes nothing else.
#
# Environment: DRA_IMAGE_NAME (default docker.io/library/gpu-dra-driver:<version>),
# DRA_IMAGE_CACHE (default ~/.cache/gpu-dra-driver/image).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
cache_root=${DRA_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-dra-driver/image}
base_image=docker.io/library/python:3.11-slim-bookworm
suite=bookworm
base_packages=python3,python3-venv,ca-certificates
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/dra_driver/__init__.py")
name=${DRA_IMAGE_NAME:-docker.io/library/gpu-dra-driver:$version}
host_ca=/etc/ssl/certs/ca-certificates.crt
storage="$cache_root/storage"
runroot="$cache_root/run"

log() { printf '[image-build %4ds] %s\n' "$SECONDS" "$*" >&2; }
bah() { buildah --root "$storage" --runroot "$runroot" --storage-driver overlay "$@"; }

# The files the build context holds (.dockerignore lets only these through).
context_files() {
  (cd "$repo" && git ls-files -z -co --exclude-standard -- \
      Dockerfile .dockerignore pyproject.toml README.md dra_driver controller deploy) |
    while IFS= read -r -d '' f; do
      case "$f" in *__pycache__*|*.pyc) continue ;; esac
      [ -f "$repo/$f" ] && printf '%s\0' "$f"
    done | sort -zu
}

base_recipe="mmdebstrap --variant=minbase $suite +$base_packages; no man/doc/locale; apt lists removed; v1"
base_key=$(echo "$base_recipe" | sha256sum | cut -c1-12)
recipe="buildah bud --layers --network host; overlay; oci-archive; $name; base $base_key by digest; v2"
key=$( (echo "$recipe"; cd "$repo" && context_files | xargs -0 sha256sum) | sha256sum | cut -c1-12)
out="$cache_root/$version-$key"

if [ -f "$out/.complete" ]; then
  log "image $name: cached in $out (base $(cat "$out/base.ref" 2>/dev/null || echo unknown))"
  echo "$out/image.oci.tar"
  exit 0
fi

missing=()
for p in buildah runc mmdebstrap; do
  command -v "$p" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || { log "missing ${missing[*]}; installing them needs root"; exit 1; }
  log "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq </dev/null >&2
  apt-get install -y -qq --no-install-recommends buildah runc mmdebstrap </dev/null >&2
fi
mkdir -p "$storage" "$runroot"

tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

have_base=$(bah inspect --type image --format '{{index .OCIv1.Config.Labels "dev.gpu-dra-driver.base-recipe"}}' \
  "$base_image" 2>/dev/null || true)
if [ "$have_base" != "$base_key" ]; then
  log "making the base $base_image from Debian $suite packages (mmdebstrap; cold: about 1 minute)"
  mmdebstrap --quiet --variant=minbase --include="$base_packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$suite" "$tmp/base.tar" \
    "deb http://deb.debian.org/debian $suite main" \
    "deb http://deb.debian.org/debian $suite-updates main" \
    "deb http://deb.debian.org/debian-security $suite-security main" </dev/null >&2
  ctr=$(bah from --quiet scratch)
  bah add --quiet "$ctr" "$tmp/base.tar" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 --label "dev.gpu-dra-driver.base-recipe=$base_key" \
    --label "org.opencontainers.image.description=stand-in for $base_image: Debian $suite + $base_packages" \
    "$ctr"
  bah commit --quiet --rm "$ctr" "$base_image" >/dev/null
  rm -f "$tmp/base.tar"
  log "base ready: $(bah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$base_image")"
fi

# The digest of the manifest in local storage, which is what `name@digest` resolves to.
base_digest=$(bah inspect --type image --format '{{.FromImageDigest}}' "$base_image")
case "$base_digest" in
  sha256:????????????????????????????????????????????????????????????????) ;;
  *) log "no manifest digest for $base_image in $storage (got '$base_digest')"; exit 1 ;;
esac
log "base pinned: $base_image@$base_digest"
build_args=(--build-arg "PYTHON_IMAGE=$base_image@$base_digest" --build-arg "PYTHON_DIGEST=$base_digest"
  --build-arg "VERSION=$version"
  --build-arg "REVISION=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
  --build-arg "SOURCE=$(git -C "$repo" remote get-url origin 2>/dev/null || echo unknown)")
if [ -f "$host_ca" ]; then
  build_args+=(--volume "$host_ca:/etc/ssl/host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/host-ca.crt)
fi
log "building $name from $repo/Dockerfile (buildah bud; cold: pip downloads the dependencies)"
build_log="$cache_root/last-build.log"
filter() {
  while IFS= read -r line; do
    case "$line" in
      STEP*|COMMIT*|*"Collecting "*|*"Successfully installed"*) log "$line" ;;
    esac
  done
}
if ! bah bud --layers --pull=never --network host "${build_args[@]}" -f "$repo/Dockerfile" -t "$name" "$repo" \
    </dev/null 2>&1 | tee "$build_log" | filter; then
  tail -40 "$build_log" >&2
  log "buildah bud failed; the whole log is $build_log"
  exit 1
fi
bah push --quiet "$name" "oci-archive:$tmp/image.oci.tar:$name" >&2
labelled=$(bah inspect --type image --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.base.digest"}}' "$name")
if [ "$labelled" != "$base_digest" ]; then
  log "the image's base.digest label is '$labelled', not the base it was built on ($base_digest)"
  exit 1
fi
echo "$base_image@$base_digest" > "$tmp/base.ref"
log "image $name: $(bah images --format '{{.Size}}' "$name") in storage, archive $(du -h "$tmp/image.oci.tar" | cut -f1)"
# The image's SBOM beside the archive (sbom.cdx.json), read out of the image itself.
sbom_ctr=$(bah from --quiet --pull=never "$name")
sbom_mnt=$(bah mount "$sbom_ctr")
cp "$sbom_mnt/opt/dra-driver/sbom.cdx.json" "$tmp/sbom.cdx.json"
bah umount "$sbom_ctr" >/dev/null
bah rm "$sbom_ctr" >/dev/null
log "SBOM: $out/sbom.cdx.json ($(grep -o '"bom-ref"' "$tmp/sbom.cdx.json" | wc -l) references)"
# Intermediate images of earlier builds: keep storage from growing with every source change.
bah rmi --prune >/dev/null 2>&1 || true
touch "$tmp/.complete"
rm -rf "$out"; mv "$tmp" "$out"
trap - EXIT
log "done: $name on base $base_image@$base_digest"
echo "$out/image.oci.tar"
