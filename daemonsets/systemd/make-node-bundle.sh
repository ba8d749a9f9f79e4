#!/bin/sh
# make-node-bundle.sh OUT.tar.gz [PYTHON_VERSION]: the node bundle node-startup.sh installs
# (docs/bootstrap.md, "The VM's software"): wheels/ (accelnode of this checkout and every
# dependency, binary wheels for CPython PYTHON_VERSION on manylinux x86_64; default: the image's
# python3 is 3.11 on Debian 12, 3.12 on Ubuntu 24.04, 3.10 on Ubuntu 22.04) and systemd/ (the
# units in this directory). Publish it where the VMs can read it and put its URL and sha256 into
# the node group's metadata (accelnode-node-bundle-url, accelnode-node-bundle-sha256).
set -eu
out=${1:?usage: make-node-bundle.sh OUT.tar.gz [PYTHON_VERSION]}
pyver=${2:-3.11}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels" "$work/systemd/kubelet.service.d"
"$python" -m pip wheel -q --no-deps -w "$work/wheels" "$root"
"$python" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform linux_x86_64 --platform any -d "$work/wheels" "$work"/wheels/accelnode-*.whl
cp "$here/kubelet.service" "$here/accelnode-bootstrap.service" "$here/containerd.service" "$work/systemd/"
cp "$here/kubelet.service.d/10-kubeadm.conf" "$work/systemd/kubelet.service.d/"
tar -czf "$out" -C "$work" --owner=0 --group=0 --sort=name wheels systemd
sha256sum "$out"
