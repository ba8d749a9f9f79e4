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
# Packages such as prometheus and containerd would start their service on install: nothing we
# install may leave a daemon running, so invoke-rc.d is told no (policy-rc.d, exit 101) meanwhile.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
