#!/bin/sh
# node-startup.sh: the GCE startup script of a TPU node group's VM (docs/bootstrap.md, "The VM's
# software"). It installs what `accelnode bootstrap` and `kubeadm join` need on a stock Debian 12
# or Ubuntu 22.04/24.04 image, pinned by the instance's metadata, and starts the join:
#
#   containerd 2.x          the release tarball at accelnode-containerd-url (containerd-<v>-linux-
#                           <arch>.tar.gz: bin/containerd, containerd-shim-runc-v2, ctr), checked
#                           against accelnode-containerd-sha256 and refused unless it is 2.x, into
#                           /usr/local/bin with the bundle's containerd.service (the images' own
#                           containerd packages are 1.x, which kubelet 1.38 no longer runs on)
#   runc                    the apt package at accelnode-runc-version (the image's own repositories)
#   kubeadm, kubelet        from accelnode-kubernetes-url (a directory holding both), each checked
#                           against accelnode-kubeadm-sha256 / accelnode-kubelet-sha256
#   accelnode               the node bundle at accelnode-node-bundle-url, checked against
#                           accelnode-node-bundle-sha256 (make-node-bundle.sh: wheels + units),
#                           into a virtualenv at /opt/accelnode
#   units                   kubelet.service (+ 10-kubeadm.conf), accelnode-bootstrap.service,
#                           containerd.service, enabled; containerd with the systemd cgroup driver; the kernel
#                           modules and sysctls kubeadm's preflight checks
#
# GCE runs it as root at every boot; it is idempotent: with the same metadata a second run
# installs nothing. A missing or malformed value, or a download whose checksum differs, stops it
# before anything is installed. Needs curl, sha256sum, tar and apt-get (all stock GCE images
# have them). Not booted with systemd (a chroot): files are installed, nothing is started.
set -eu

MD="http://${GCE_METADATA_HOST:-169.254.169.254}/computeMetadata/v1/instance/attributes"
STATE=/var/lib/accelnode/node-software
ARCH=$(dpkg --print-architecture)

log() { echo "accelnode node-startup: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

attr() {  # attr KEY: the instance attribute's value; empty when it is not set
    out=$(curl -fsS --retry 10 --retry-connrefused --retry-delay 1 -H 'Metadata-Flavor: Google' "$MD/$1" 2>/dev/null) \
        || out=""
    printf '%s' "$out"
}

need() {  # need KEY PATTERN: the attribute, which must match the extended regex PATTERN
    v=$(attr "$1")
    [ -n "$v" ] || die "instance metadata $1 is not set (see docs/bootstrap.md, \"The VM's software\")"
    printf '%s' "$v" | grep -Eqx "$2" || die "instance metadata $1='$v' is malformed (expected $2)"
    printf '%s' "$v"
}

fetch() {  # fetch URL SHA256 OUT: download and check, or stop
    curl -fsSL --retry 5 --retry-connrefused -o "$3" "$1" || die "downloading $1 failed"
    got=$(sha256sum "$3" | cut -d' ' -f1)
    [ "$got" = "$2" ] || die "$1 has sha256 $got, the metadata pins $2: not installed"
}

booted() { [ -d /run/systemd/system ]; }

SHA='[0-9a-f]{64}'
URL='(https?|file)://[^[:space:]]+'
VERSION='[A-Za-z0-9.+:~-]+'
containerd_url=$(need accelnode-containerd-url "$URL")
containerd_sha=$(need accelnode-containerd-sha256 "$SHA")
runc_v=$(need accelnode-runc-version "$VERSION")
k8s_url=$(need accelnode-kubernetes-url "$URL")
kubeadm_sha=$(need accelnode-kubeadm-sha256 "$SHA")
kubelet_sha=$(need accelnode-kubelet-sha256 "$SHA")
bundle_url=$(need accelnode-node-bundle-url "$URL")
bundle_sha=$(need accelnode-node-bundle-sha256 "$SHA")
want="containerd=$containerd_sha runc=$runc_v kubeadm=$kubeadm_sha kubelet=$kubelet_sha bundle=$bundle_sha"

if [ "$(cat "$STATE" 2>/dev/null)" != "$want" ]; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # everything is fetched and checked before anything is installed
    fetch "${k8s_url%/}/kubeadm" "$kubeadm_sha" "$work/kubeadm"
    fetch "${k8s_url%/}/kubelet" "$kubelet_sha" "$work/kubelet"
    fetch "$containerd_url" "$containerd_sha" "$work/containerd.tar.gz"
    mkdir "$work/containerd"
    tar -xzf "$work/containerd.tar.gz" -C "$work/containerd" || die "$containerd_url is not a tar.gz"
    for b in containerd containerd-shim-runc-v2 ctr; do
        [ -f "$work/containerd/bin/$b" ] || die "$containerd_url holds no bin/$b"
    done
    containerd_v=$("$work/containerd/bin/containerd" --version 2>/dev/null | awk '{print $3}')
    case "$containerd_v" in
        v2.*) ;;
        *) die "$containerd_url is containerd '${containerd_v:-?}', not 2.x: not installed" ;;
    esac
    fetch "$bundle_url" "$bundle_sha" "$work/bundle.tar.gz"
    mkdir "$work/bundle"
    tar -xzf "$work/bundle.tar.gz" -C "$work/bundle" || die "$bundle_url is not a tar.gz"
    ls "$work/bundle/wheels/"accelnode-*.whl >/dev/null 2>&1 || die "$bundle_url holds no wheels/accelnode-*.whl"

    log "installing containerd $containerd_v, runc $runc_v ($ARCH)"
    pkgs="runc=$runc_v python3 python3-venv conntrack iptables"
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $pkgs >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $pkgs; } \
        || die "apt-get install $pkgs failed"
    apt-mark hold runc >/dev/null
    for b in containerd containerd-shim-runc-v2 ctr; do
        install -m 0755 "$work/containerd/bin/$b" "/usr/local/bin/$b"
    done

    log "installing kubeadm, kubelet from $k8s_url"
    install -m 0755 "$work/kubeadm" /usr/local/bin/kubeadm
    install -m 0755 "$work/kubelet" /usr/local/bin/kubelet

    log "installing accelnode into /opt/accelnode"
    rm -rf /opt/accelnode
    python3 -m venv /opt/accelnode
    /opt/accelnode/bin/pip install -q --no-index --find-links "$work/bundle/wheels" accelnode \
        || die "pip install accelnode from the bundle failed"
    ln -sf /opt/accelnode/bin/accelnode /usr/local/bin/accelnode

    log "installing the units"
    install -d /etc/systemd/system/kubelet.service.d
    install -m 0644 "$work/bundle/systemd/kubelet.service" /etc/systemd/system/kubelet.service
    install -m 0644 "$work/bundle/systemd/kubelet.service.d/10-kubeadm.conf" \
        /etc/systemd/system/kubelet.service.d/10-kubeadm.conf
    install -m 0644 "$work/bundle/systemd/accelnode-bootstrap.service" /etc/systemd/system/accelnode-bootstrap.service
    install -m 0644 "$work/bundle/systemd/containerd.service" /etc/systemd/system/containerd.service

    # containerd: the systemd cgroup driver, as kubelet's (kubeadm's default)
    install -d /etc/containerd
    /usr/local/bin/containerd config default | sed 's/SystemdCgroup = false/SystemdCgroup = true/' > /etc/containerd/config.toml
    install -d /etc/modules-load.d /etc/sysctl.d
    printf 'overlay\nbr_netfilter\n' > /etc/modules-load.d/kubernetes.conf
    printf 'net.ipv4.ip_forward = 1\nnet.bridge.bridge-nf-call-iptables = 1\nnet.bridge.bridge-nf-call-ip6tables = 1\n' \
        > /etc/sysctl.d/99-kubernetes.conf

    mkdir -p "$(dirname "$STATE")"
    printf '%s' "$want" > "$STATE"
    log "installed: $want"
else
    log "already installed: $want"
fi

# enabled as `systemctl enable` would (it needs a running systemd)
install -d /etc/systemd/system/multi-user.target.wants
for unit in kubelet.service accelnode-bootstrap.service containerd.service; do
    ln -sf "/etc/systemd/system/$unit" "/etc/systemd/system/multi-user.target.wants/$unit"
done

if booted; then
    modprobe overlay && modprobe br_netfilter || log "modprobe failed: kubeadm's preflight will say what is missing"
    sysctl -q --system
    systemctl daemon-reload
    systemctl restart containerd
    systemctl start --no-block accelnode-bootstrap.service
else
    log "not booted with systemd: files installed, nothing started"
fi
