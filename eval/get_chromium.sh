#!/usr/bin/env bash
# Fetch Debian's headless Chromium shell and the libraries it needs beyond a base system with `apt-get download`
# and unpack them under $SPECQUANT_HOME/chromium (no system install, no root needed beyond apt's cache). Used by
# `specquant report screenshot=PATH` (toolkit/report/screenshot.py) to check the HTML page renders offline.
set -euo pipefail
DEST=${SPECQUANT_HOME:-$HOME/.cache/specquant}/chromium
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
# the packages `apt-get install --no-install-recommends chromium-headless-shell` would add on Debian 12
mapfile -t PKGS < <(apt-get install --dry-run -y --no-install-recommends chromium-headless-shell 2>/dev/null |
                    awk '/^Inst/ {print $2}')
[[ ${#PKGS[@]} -gt 0 ]] || PKGS=(chromium-headless-shell chromium-common)
apt-get download "${PKGS[@]}"
mkdir -p "$DEST"
for deb in *.deb; do dpkg -x "$deb" "$DEST"; done
echo "unpacked ${#PKGS[@]} packages into $DEST"
