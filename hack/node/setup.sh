#!/usr/bin/env bash
# Installs the Debian packages a real test node needs (runc, the CNI plugins, catatonit
# for the pause image, busybox-static for the test image). Non-interactive; runs
# `apt-get update` first, and does nothing when every package is already installed.
# Changes nothing else on the host.
set -euo pipefail

packages=(runc containernetworking-plugins catatonit busybox-static)
log() { printf '[node-setup %4ds] %s\n' "$SECONDS" "$*" >&2; }

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  log "Debian packages present: ${packages[*]}"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  log "missing ${missing[*]}; installing them needs root"
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
log "apt-get update"
apt-get update -qq </dev/null >&2
log "installing ${missing[*]}"
apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null >&2
log "done"
