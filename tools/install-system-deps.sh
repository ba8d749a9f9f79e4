#!/usr/bin/env bash
# Install the Debian packages listed in tools/apt/*.txt that are not installed yet.
# Idempotent and quiet when nothing is missing; needs root (apt-get) only when something is.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=$(cat tools/apt/*.txt 2>/dev/null | sed 's/#.*//' | tr -s ' \n' '\n' | sort -u)
missing=()
for p in $pkgs; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing Debian packages: ${missing[*]}; run as root (or: apt-get install ${missing[*]})" >&2
  exit 3
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
