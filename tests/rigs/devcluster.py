"""A real, throwaway Kubernetes control plane on loopback: etcd, kube-apiserver and
kube-controller-manager.

Used by the pytest fixture (``tests/fixtures/cluster.py``) and by ``make cluster``
(``python -m tests.rigs.devcluster``). The binaries are the real ones, built from their Go
modules into ``.tools/bin`` by ``make tools`` (``tools/mk/k8s.mk``).

What one :class:`ControlPlane` sets up in its work directory:

- a CA, a serving certificate for 127.0.0.1/localhost and the in-cluster service names, and
  an ECDSA key that signs service-account tokens;
- etcd on two free loopback ports (client, peer), data in ``etcd/`` (removed on stop);
- kube-apiserver on a free loopback port with client-certificate authentication, RBAC
  authorization, service-account token issuing and an audit log of every write
  (``audit.log``), and the admission configuration GKE runs its own with
  (:data:`GKE_ADMISSION`: critical-priority pods only where a ResourceQuota admits them, and
  kube-system's quota that does, :func:`gke_objects`);
- kube-controller-manager on a free loopback port as ``system:kube-controller-manager``, each
  controller with its own ServiceAccount credentials: garbage collection, namespace deletion,
  PV/PVC binding, Deployments, StatefulSets, Jobs, CSR signing with the CA, bootstrap tokens;
  nothing that needs a kubelet or acts on Nodes (see :data:`CONTROLLERS`) - unless
  ``kubelets=True``: then also kube-scheduler, the Node controllers, the Node authorizer and
  ServiceAccount admission, for real kubelets (``tests/rigs/node.py``);
- one client certificate and kubeconfig per identity in :data:`IDENTITIES` (and one for the
  controller-manager, :data:`CONTROLLER_MANAGER`);
- what ``kubeadm init`` leaves in the cluster for ``kubeadm join`` (:func:`kubeadm_objects`): the
  ``kube-public/cluster-info`` ConfigMap the bootstrap signer signs for token discovery (readable
  anonymously), ``kube-system/kubeadm-config`` and ``kubelet-config``, and the RBAC that lets
  bootstrap-token holders read them, file CSRs and get them approved.

The component identities carry the user name and groups a pod running as the component's
ServiceAccount gets, so the ClusterRoleBindings in ``daemonsets/`` apply to them unchanged.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NAMESPACE = "accelnode-system"
SERVICE_CIDR = "10.96.0.0/12"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
ISSUER = "https://kubernetes.default.svc.cluster.local"
CRD_DIR = Path(__file__).resolve().parents[2] / "daemonsets" / "crds"


def crd_args() -> list[str]:
    """``kubectl apply`` arguments for the CRDs, as ``apply -k daemonsets/crds/`` installs them
    (``-f`` of the directory would also send its kustomization.yaml), for a command that applies
    other files with ``-f`` beside them."""
    listed = yaml.safe_load((CRD_DIR / "kustomization.yaml").read_text())["resources"]
    return [a for name in listed for a in ("-f", str(CRD_DIR / name))]


@dataclass(frozen=True)
class Identity:
    """A client-certificate identity: CN becomes the user name, each O a group."""

    name: str
    user: str
    groups: tuple[str, ...]


def _service_account(component: str) -> Identity:
    sa = f"accelnode-{component}"
    return Identity(
        component,
        f"system:serviceaccount:{NAMESPACE}:{sa}",
        ("system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}"),
    )


IDENTITIES = (
    Identity("admin", "accelnode-admin", ("system:masters",)),
    *(_service_account(c) for c in ("device-plugin", "csi", "agent", "controller")),
)

# The user the apiserver's bootstrap RBAC policy grants the controller-manager's rights to.
CONTROLLER_MANAGER = Identity("kube-controller-manager", "system:kube-controller-manager", ())

# The user the bootstrap RBAC policy grants the scheduler's rights to (kubelets=True only).
SCHEDULER = Identity("kube-scheduler", "system:kube-scheduler", ())

# Every default controller, the two token controllers that are off by default (so bootstrap
# tokens work), and none of those that act on Nodes as if kubelets ran them: our Nodes are bare
# records with no kubelet posting status, so the node lifecycle controller would mark them
# NotReady and taint them unreachable, the taint-eviction controller would then delete their
# pods, and the TTL controller would annotate every Node (each a watch event for the agents).
CONTROLLERS = ("*", "bootstrap-signer-controller", "token-cleaner-controller",
               "-node-lifecycle-controller", "-taint-eviction-controller", "-ttl-controller")


# GKE's setting "critical pods only in kube-system by default": kube-apiserver's ResourceQuota
# admission plugin configured with limitedResources for pods of the two system priority classes,
# so that such a pod is admitted only in a namespace holding a ResourceQuota whose scopeSelector
# matches its class. GKE's own control-plane configuration is not public; this is the one
# Kubernetes' GCE scripts write (kubernetes/kubernetes cluster/gce/gci/configure-helper.sh, the
# ADMISSION_CONTROL block writing admission_controller_config.yaml, "to limit critical pods to
# kube-system by default"; the same shape on kubernetes.io, "Limiting PriorityClass consumption by
# default"), and what GKE users meet: "insufficient quota to match these scopes: [{PriorityClass In
# [system-node-critical system-cluster-critical]}]" (open-policy-agent/gatekeeper#1120,
# openservicemesh/osm#4408, dapr/dapr#7783). Notes: ../shared/reference/gke.md section 1.
CRITICAL_CLASSES = ["system-node-critical", "system-cluster-critical"]
GKE_ADMISSION = {
    "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
    "plugins": [{"name": "ResourceQuota", "configuration": {
        "apiVersion": "apiserver.config.k8s.io/v1", "kind": "ResourceQuotaConfiguration",
        "limitedResources": [{"resource": "pods", "matchScopes": [
            {"scopeName": "PriorityClass", "operator": "In", "values": CRITICAL_CLASSES}]}]}}],
}


def gke_objects() -> list[tuple[str, dict]]:
    """What GKE keeps in kube-system so that its own critical pods are admitted: the quota
    ``gcp-critical-pods`` (name, ``hard`` and label as GKE's, per gatekeeper#1120 and osm#4408)."""
    return [("/api/v1/namespaces/kube-system/resourcequotas", {
        "apiVersion": "v1", "kind": "ResourceQuota",
        "metadata": {"name": "gcp-critical-pods", "namespace": "kube-system",
                     "labels": {"addonmanager.kubernetes.io/mode": "Reconcile"}},
        "spec": {"hard": {"pods": "1G"}, "scopeSelector": {"matchExpressions": [
            {"scopeName": "PriorityClass", "operator": "In", "values": CRITICAL_CLASSES}]}}})]


class ControlPlaneError(RuntimeError):
    """The control plane could not start (the message carries the log tail)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# certificates


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _cert(subject: x509.Name, key, issuer: x509.Name, signer, *, ca: bool, extensions=()) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    )
    for ext in extensions:
        b = b.add_extension(ext, critical=False)
    return b.sign(signer, hashes.SHA256())


class _PKI:
    """CA, serving pair, service-account signing key and client pairs under one directory."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._ca_key = _key()
        self._ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "accelnode-devcluster-ca")])
        ca = _cert(self._ca_name, self._ca_key, self._ca_name, self._ca_key, ca=True)
        self.ca = root / "ca.crt"
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        self.ca_key = root / "ca.key"  # the controller-manager signs approved CSRs with it
        _write_key(self.ca_key, self._ca_key)

        self.sa_key = root / "sa.key"
        self.sa_pub = root / "sa.pub"
        sa = _key()
        _write_key(self.sa_key, sa)
        self.sa_pub.write_bytes(
            sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )

        names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local"]
        san = x509.SubjectAlternativeName(
            [x509.DNSName(n) for n in names]
            + [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", SERVICE_IP)]
        )
        self.serving = self._pair("apiserver", x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
                                  ExtendedKeyUsageOID.SERVER_AUTH, san)
        loopback = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        self.controller_manager_serving = self._pair(
            "controller-manager", x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-controller-manager")]),
            ExtendedKeyUsageOID.SERVER_AUTH, loopback)

    def client(self, ident: Identity) -> tuple[Path, Path]:
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in ident.groups]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, ident.user))
        return self._pair(f"client-{ident.name}", x509.Name(attrs), ExtendedKeyUsageOID.CLIENT_AUTH)

    def _pair(self, stem: str, subject: x509.Name, usage, *extra) -> tuple[Path, Path]:
        key = _key()
        cert = _cert(subject, key, self._ca_name, self._ca_key, ca=False,
                     extensions=(x509.ExtendedKeyUsage([usage]), *extra))
        crt, keyfile = self.root / f"{stem}.crt", self.root / f"{stem}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(keyfile, key)
        return crt, keyfile


# ---------------------------------------------------------------------------------------------
# what `kubeadm init` creates for joining nodes (its bootstrap-token and upload-config phases)

BOOTSTRAPPERS = "system:bootstrappers:kubeadm:default-node-token"


def _rbac(kind: str, name: str, namespace: str | None, **body) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta, **body}


def _binding(kind: str, name: str, namespace: str | None, role_kind: str, role: str, subjects: list[dict]) -> dict:
    return _rbac(kind, name, namespace, roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                                 "name": role}, subjects=subjects)


def _group(name: str) -> dict:
    return {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": name}


def kubeadm_objects(server: str, ca_pem: bytes, kubernetes_version: str) -> list[tuple[str, dict]]:
    """(collection path, object) for what ``kubeadm init`` creates so that ``kubeadm join``
    with a bootstrap token works: the same names, contents and rights."""
    cluster_info = yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "", "cluster": {"server": server,
                                              "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "contexts": None, "current-context": "", "preferences": {}, "users": None}, sort_keys=False)
    host, _, port = server.removeprefix("https://").rpartition(":")
    cluster_config = yaml.safe_dump({
        "apiVersion": "kubeadm.k8s.io/v1beta4", "kind": "ClusterConfiguration", "clusterName": "kubernetes",
        "kubernetesVersion": kubernetes_version, "controlPlaneEndpoint": f"{host}:{port}",
        "certificatesDir": "/etc/kubernetes/pki", "imageRepository": "registry.k8s.io",
        "networking": {"dnsDomain": "cluster.local", "serviceSubnet": SERVICE_CIDR}}, sort_keys=False)
    kubelet_config = yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "systemd", "clusterDNS": ["10.96.0.10"], "clusterDomain": "cluster.local",
        "rotateCertificates": True, "staticPodPath": "/etc/kubernetes/manifests",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": "/etc/kubernetes/pki/ca.crt"}},
        "authorization": {"mode": "Webhook"}}, sort_keys=False)
    cm = lambda ns, name, data: (f"/api/v1/namespaces/{ns}/configmaps",  # noqa: E731
                                 {"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": {"name": name, "namespace": ns}, "data": data})
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    kube_system, kube_public = f"{rbac}/namespaces/kube-system", f"{rbac}/namespaces/kube-public"
    readers = [_group(BOOTSTRAPPERS), _group("system:nodes")]
    return [
        cm("kube-public", "cluster-info", {"kubeconfig": cluster_info}),
        (f"{kube_public}/roles", _rbac("Role", "kubeadm:bootstrap-signer-clusterinfo", "kube-public", rules=[
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["cluster-info"], "verbs": ["get"]}])),
        (f"{kube_public}/rolebindings", _binding("RoleBinding", "kubeadm:bootstrap-signer-clusterinfo", "kube-public",
                                                 "Role", "kubeadm:bootstrap-signer-clusterinfo",
                                                 [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                                   "name": "system:anonymous"}])),
        cm("kube-system", "kubeadm-config", {"ClusterConfiguration": cluster_config}),
        cm("kube-system", "kubelet-config", {"kubelet": kubelet_config}),
        (f"{kube_system}/roles", _rbac("Role", "kubeadm:nodes-kubeadm-config", "kube-system", rules=[
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["kubeadm-config"], "verbs": ["get"]}])),
        (f"{kube_system}/rolebindings", _binding("RoleBinding", "kubeadm:nodes-kubeadm-config", "kube-system", "Role",
                                                 "kubeadm:nodes-kubeadm-config", readers)),
        (f"{kube_system}/roles", _rbac("Role", "kubeadm:kubelet-config", "kube-system", rules=[
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["kubelet-config"], "verbs": ["get"]}])),
        (f"{kube_system}/rolebindings", _binding("RoleBinding", "kubeadm:kubelet-config", "kube-system", "Role",
                                                 "kubeadm:kubelet-config", readers)),
        (f"{rbac}/clusterroles", _rbac("ClusterRole", "kubeadm:get-nodes", None, rules=[
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}])),
        (f"{rbac}/clusterrolebindings", _binding("ClusterRoleBinding", "kubeadm:get-nodes", None, "ClusterRole",
                                                 "kubeadm:get-nodes", [_group(BOOTSTRAPPERS)])),
        (f"{rbac}/clusterrolebindings", _binding("ClusterRoleBinding", "kubeadm:kubelet-bootstrap", None,
                                                 "ClusterRole", "system:node-bootstrapper", [_group(BOOTSTRAPPERS)])),
        (f"{rbac}/clusterrolebindings", _binding(
            "ClusterRoleBinding", "kubeadm:node-autoapprove-bootstrap", None, "ClusterRole",
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient", [_group(BOOTSTRAPPERS)])),
        (f"{rbac}/clusterrolebindings", _binding(
            "ClusterRoleBinding", "kubeadm:node-autoapprove-certificate-rotation", None, "ClusterRole",
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient", [_group("system:nodes")])),
    ]


# ---------------------------------------------------------------------------------------------
# processes

_AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}


def _die_with_parent() -> None:
    """Child side of Popen: be killed if the launching process dies without cleaning up.

    SIGKILL, not SIGTERM: every server would get it at once, and a terminating kube-apiserver
    whose etcd is already gone lingers for half a minute. The data is throwaway anyway.
    """
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class _Proc:
    """One server process with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path):
        self.name, self.argv, self.log = name, argv, log
        self.popen: subprocess.Popen | None = None

    def start(self) -> None:
        # Own session: a terminal's Ctrl-C reaches only our process, which stops the servers in
        # order (kube-controller-manager, kube-apiserver, etcd).
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=_die_with_parent)

    def exited(self) -> bool:
        """Started, and no longer running (a stopped process does not count)."""
        return self.popen is not None and self.popen.poll() is not None

    def failure(self, why: str) -> ControlPlaneError:
        return ControlPlaneError(f"{self.name} {why}; last lines of {self.log}:\n{_tail(self.log)}")

    def stop(self, grace: float = 15.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.popen = None


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager on loopback, owned by this object.

    ``start()`` returns once the apiserver's ``/readyz`` answers 200, the ``default`` namespace
    exists and the controller-manager's ``/healthz`` answers 200, or raises
    :class:`ControlPlaneError` with the failing server's log tail. ``stop()`` ends all three
    (SIGTERM, then SIGKILL), waits for them and removes the etcd data. Safe to call twice.
    """

    def __init__(self, workdir: Path, tools_bin: Path, *, start_timeout: float = 120.0, kubelets: bool = False,
                 apiserver_args: tuple[str, ...] = (), audit_reads_of: tuple[str, ...] = ()):
        """``kubelets=True``: ready for real kubelets (tests/rigs/node.py): the Node
        authorizer beside RBAC, ServiceAccount admission (pods get their token volume), a
        client certificate the apiserver shows kubelets (logs, exec), and kube-scheduler.
        ``apiserver_args``: more kube-apiserver flags (a test's own control plane, e.g. a
        feature gate). ``audit_reads_of``: user names whose get, list and watch calls the audit
        log records too (Metadata level: verb, requestURI, user agent), beside everyone's writes."""
        self.kubelets = kubelets
        self.audit_reads_of = tuple(audit_reads_of)
        self.apiserver_args = tuple(apiserver_args)
        self.etcd_url = ""  # http://127.0.0.1:<port> once started (etcd's JSON gateway: /v3/...)
        self.workdir = Path(workdir)
        self.tools_bin = Path(tools_bin)
        self.start_timeout = start_timeout
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.audit_log = self.workdir / "audit.log"
        self.controller_manager_port = free_port()
        self._etcd: _Proc | None = None
        self._apiserver: _Proc | None = None
        self._controller_manager: _Proc | None = None
        self._scheduler: _Proc | None = None
        self.scheduler_port = free_port()
        self._kubeconfigs: dict[str, Path] = {}
        self._clients: dict[str, tuple[Path, Path]] = {}
        self._pki: _PKI | None = None

    # -- public surface ------------------------------------------------------------------------

    @property
    def ca_file(self) -> Path:
        assert self._pki is not None, "start() first"
        return self._pki.ca

    def kubeconfig(self, identity: str = "admin") -> Path:
        """Path of the kubeconfig for one of :data:`IDENTITIES` (by ``Identity.name``)."""
        try:
            return self._kubeconfigs[identity]
        except KeyError:
            raise KeyError(f"no identity {identity!r}; known: {sorted(self._kubeconfigs)}") from None

    def node_kubeconfig(self, node: str) -> Path:
        """A kubeconfig for kubelet on ``node``: user ``system:node:<node>`` in ``system:nodes``."""
        assert self._pki is not None, "start() first"
        ident = Identity(f"node-{node}", f"system:node:{node}", ("system:nodes",))
        if ident.name not in self._kubeconfigs:
            self._clients[ident.name] = self._pki.client(ident)
            self._kubeconfigs[ident.name] = self._write_kubeconfig(ident)
        return self._kubeconfigs[ident.name]

    def serving_pair(self, name: str) -> tuple[Path, Path]:
        """A serving certificate and key for 127.0.0.1/localhost signed by the cluster CA
        (:attr:`ca_file`): for servers a test runs that the apiserver calls (webhooks)."""
        assert self._pki is not None, "start() first"
        loopback = x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        return self._pki._pair(f"serving-{name}", x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]),
                               ExtendedKeyUsageOID.SERVER_AUTH, loopback)

    def start(self) -> None:
        etcd, apiserver = self._binary("etcd"), self._binary("kube-apiserver")
        controller_manager = self._binary("kube-controller-manager")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._pki = _PKI(self.workdir / "pki")
        for ident in (*IDENTITIES, CONTROLLER_MANAGER, *((SCHEDULER,) if self.kubelets else ())):
            self._clients[ident.name] = self._pki.client(ident)
            self._kubeconfigs[ident.name] = self._write_kubeconfig(ident)
        policy = self.workdir / "audit-policy.yaml"
        reads = [{"level": "Metadata", "users": list(self.audit_reads_of), "verbs": ["get", "list", "watch"]}]
        policy.write_text(yaml.safe_dump(dict(_AUDIT_POLICY, rules=[*(reads if self.audit_reads_of else []),
                                                                    *_AUDIT_POLICY["rules"]])))
        admission = self.workdir / "admission.yaml"
        admission.write_text(yaml.safe_dump(GKE_ADMISSION))
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._etcd = _Proc("etcd", [
            etcd, "--name=devcluster", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}", f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=devcluster=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn",
        ], self.workdir / "etcd.log")
        self._apiserver = _Proc("kube-apiserver", [
            apiserver, "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            # The `kubernetes` Service's endpoints would be the advertised 127.0.0.1, which an
            # Endpoints object may not hold: 1.35 started with it, 1.37 refuses to start
            # ("cannot use public IP 127.0.0.1 with endpoint reconciler"). Pods here reach the API
            # at 127.0.0.1 through KUBERNETES_SERVICE_HOST (tests/rigs/node.py write_overlay).
            "--endpoint-reconciler-type=none",
            f"--etcd-servers=http://127.0.0.1:{client}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={self._pki.serving[0]}", f"--tls-private-key-file={self._pki.serving[1]}",
            f"--client-ca-file={self._pki.ca}",
            "--authorization-mode=Node,RBAC" if self.kubelets else "--authorization-mode=RBAC",
            # kubeadm's token discovery: a joining node reads kube-public/cluster-info anonymously
            # (RBAC lets system:anonymous read only that and the public /healthz, /version) and
            # then authenticates with its bootstrap token
            "--anonymous-auth=true", "--enable-bootstrap-token-auth=true",
            f"--service-account-issuer={ISSUER}", f"--service-account-key-file={self._pki.sa_pub}",
            f"--service-account-signing-key-file={self._pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # The controller-manager creates each namespace's `default` ServiceAccount, which
            # this admission plugin insists on for every pod, but only a moment after the
            # namespace: tests create pods right after their namespace.
            *(self._kubelet_flags() if self.kubelets else ["--disable-admission-plugins=ServiceAccount"]),
            "--allow-privileged=true", "--profiling=false",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
            f"--admission-control-config-file={admission}",  # GKE_ADMISSION
            *self.apiserver_args,
        ], self.workdir / "kube-apiserver.log")
        kubeconfig = self.kubeconfig(CONTROLLER_MANAGER.name)
        self._controller_manager = _Proc("kube-controller-manager", [
            controller_manager, "--bind-address=127.0.0.1", f"--secure-port={self.controller_manager_port}",
            f"--tls-cert-file={self._pki.controller_manager_serving[0]}",
            f"--tls-private-key-file={self._pki.controller_manager_serving[1]}",
            f"--kubeconfig={kubeconfig}",
            # who may read its /metrics: asked of the apiserver (/healthz is open to all); there
            # is no front proxy, so no request-header CA to look up in kube-system
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            f"--client-ca-file={self._pki.ca}", "--authentication-skip-lookup=true",
            # with real kubelets the Node controllers have real Nodes to act on (the node
            # lifecycle controller lifts the not-ready taint kubelet registers with)
            f"--controllers={','.join(CONTROLLERS[:3] if self.kubelets else CONTROLLERS)}",
            # each controller acts as its own ServiceAccount in kube-system, with the rights the
            # bootstrap policy gives it, as in a real cluster
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self._pki.sa_key}", f"--root-ca-file={self._pki.ca}",
            f"--cluster-signing-cert-file={self._pki.ca}", f"--cluster-signing-key-file={self._pki.ca_key}",
            "--leader-elect=false", "--profiling=false",
        ], self.workdir / "kube-controller-manager.log")
        if self.kubelets:  # pods for a real kubelet need binding to its Node
            kubeconfig = self.kubeconfig(SCHEDULER.name)
            self._scheduler = _Proc("kube-scheduler", [
                self._binary("kube-scheduler"), "--bind-address=127.0.0.1", f"--secure-port={self.scheduler_port}",
                f"--tls-cert-file={self._pki.controller_manager_serving[0]}",
                f"--tls-private-key-file={self._pki.controller_manager_serving[1]}",
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--authentication-skip-lookup=true",
                "--leader-elect=false", "--profiling=false",
            ], self.workdir / "kube-scheduler.log")
        try:
            self._etcd.start()
            self._wait(self._etcd, f"http://127.0.0.1:{client}/readyz", None)
            self.start_apiserver()
            self._create_kubeadm_objects()
        except BaseException:
            self.stop()
            raise

    def start_apiserver(self) -> None:
        """(Re)start kube-apiserver on the same port and wait until it is ready, then the
        controller-manager."""
        assert self._apiserver is not None and self._controller_manager is not None, "start() first"
        self._apiserver.start()
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(*self._clients["admin"])
        self._wait(self._apiserver, f"{self.url}/readyz", ctx)
        self._wait(self._apiserver, f"{self.url}/api/v1/namespaces/default", ctx)
        self._controller_manager.start()
        self._wait(self._controller_manager, f"https://127.0.0.1:{self.controller_manager_port}/healthz",
                   ssl.create_default_context(cafile=str(self.ca_file)))
        if self._scheduler is not None:
            self._scheduler.start()
            self._wait(self._scheduler, f"https://127.0.0.1:{self.scheduler_port}/healthz",
                       ssl.create_default_context(cafile=str(self.ca_file)))

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (etcd keeps the data): clients see the API go away.

        The controller-manager stops first and comes back with the API in ``start_apiserver()``:
        it exits when it loses the API while it is still starting its controllers, and its
        requests in flight can hold the apiserver's shutdown up until the kill.
        """
        for proc in (self._scheduler, self._controller_manager, self._apiserver):
            if proc is not None:
                proc.stop()

    def stop(self) -> None:
        for proc in (self._scheduler, self._controller_manager, self._apiserver, self._etcd):
            if proc is not None:
                proc.stop()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)

    def check_running(self) -> None:
        """Raise :class:`ControlPlaneError` if one of the servers has exited."""
        for proc in (self._etcd, self._apiserver, self._controller_manager, self._scheduler):
            if proc is not None and proc.exited():
                raise proc.failure("exited")

    def __enter__(self) -> "ControlPlane":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------------

    def _kubelet_flags(self) -> list[str]:
        crt, key = self._pki.client(Identity("kubelet-client", "kube-apiserver-kubelet-client", ("system:masters",)))
        return [f"--kubelet-client-certificate={crt}", f"--kubelet-client-key={key}",
                # kubelets here are named with --hostname-override: reach them by their node IP
                "--kubelet-preferred-address-types=InternalIP", "--enable-admission-plugins=NodeRestriction"]

    def _create_kubeadm_objects(self) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(*self._clients["admin"])
        version = subprocess.run([self._binary("kube-apiserver"), "--version"], capture_output=True, text=True,
                                 check=True).stdout.split()[-1].lstrip("v")
        for path, obj in [*kubeadm_objects(self.url, self.ca_file.read_bytes(), version), *gke_objects()]:
            req = urllib.request.Request(self.url + path, data=json.dumps(obj).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, context=ctx, timeout=10).close()
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    raise ControlPlaneError(f"creating {obj['kind']} {obj['metadata']['name']}: HTTP {e.code}: "
                                            f"{e.read(300).decode(errors='replace')}") from None

    def _binary(self, name: str) -> str:
        path = self.tools_bin / name
        if not os.access(path, os.X_OK):
            raise ControlPlaneError(f"{path} is missing: build it with `make tools`")
        return str(path)

    def _write_kubeconfig(self, ident: Identity) -> Path:
        crt, key = self._clients[ident.name]
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "devcluster", "cluster": {"server": self.url, "certificate-authority": str(self._pki.ca)}}],
            "users": [{"name": ident.name, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
            "contexts": [{"name": ident.name, "context": {"cluster": "devcluster", "user": ident.name}}],
            "current-context": ident.name,
        }
        path = self.workdir / f"kubeconfig-{ident.name}"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)
        return path

    def _wait(self, proc: _Proc, url: str, ctx: ssl.SSLContext | None) -> None:
        deadline = time.monotonic() + self.start_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if proc.exited():
                raise proc.failure("exited during startup")
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read(300).decode(errors='replace')}"
            except OSError as e:
                last = str(e)
            time.sleep(0.25)
        raise proc.failure(f"not ready at {url} after {self.start_timeout:.0f}s ({last})")


# ---------------------------------------------------------------------------------------------
# `make cluster`


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(
        prog="python -m tests.rigs.devcluster",
        description="Run a local etcd + kube-apiserver + kube-controller-manager in the foreground until Ctrl-C.")
    p.add_argument("--tools-bin", type=Path, default=Path(os.environ.get("ACCELNODE_TOOLS_BIN", root / ".tools/bin")),
                   help="where etcd, kube-apiserver and kube-controller-manager are (default: .tools/bin)")
    p.add_argument("--dir", type=Path, help="work directory (default: a new temporary directory, removed at exit)")
    args = p.parse_args(argv)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="accelnode-cluster-"))
    cp = ControlPlane(workdir, args.tools_bin)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        cp.start()
    except ControlPlaneError as e:
        print(f"devcluster: {e}", file=sys.stderr)
        return 1
    try:
        print(f"""kube-apiserver ready at {cp.url} (work directory {workdir})

  export KUBECONFIG={cp.kubeconfig('admin')}
  alias kubectl={args.tools_bin / 'kubectl'}   # built from the apiserver's release
  kubectl apply -k {root / 'daemonsets/crds'}
  kubectl get --raw /readyz

Kubeconfigs for the component identities (RBAC applies to them):""")
        for ident in IDENTITIES[1:]:
            print(f"  {ident.name:14} {cp.kubeconfig(ident.name)}  ({ident.user})")
        print(f"Logs: {workdir}/kube-apiserver.log, {workdir}/kube-controller-manager.log, {workdir}/etcd.log, "
              f"audit {cp.audit_log}\nCtrl-C stops it.", flush=True)
        while stop["signal"] is None:
            cp.check_running()
            time.sleep(0.5)
        return 0
    except ControlPlaneError as e:
        print(f"devcluster: {e}", file=sys.stderr)
        return 1
    finally:
        cp.stop()
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        print("devcluster: stopped", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
