"""kubeadm bootstrap tokens and CA pins: the facts both sides of a join must agree on
(the controller that hands a token out, the node that joins with it; docs/bootstrap.md).

- A token is ``<id>.<secret>``: 6 and 16 lower-case letters or digits; its Secret is
  ``kube-system/bootstrap-token-<id>``.
- A CA is pinned by ``sha256:<hex>`` of its certificate's DER SubjectPublicKeyInfo, as
  ``kubeadm join --discovery-token-ca-cert-hash`` checks it.
- The node group's VMs find the three values under these GCE metadata keys.
"""

from __future__ import annotations

import hashlib
import re

from cryptography import x509
from cryptography.hazmat.primitives import serialization

METADATA_KEYS = ("kubeadm-join-token", "kubeadm-control-plane-ip", "kubeadm-ca-hash")
TOKEN_RE = re.compile(r"^([a-z0-9]{6})\.([a-z0-9]{16})$")
HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# kubeadm-control-plane-ip: host[:port], an IPv6 address in brackets
ENDPOINT_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?$")


def spki_hash(cert: x509.Certificate) -> str:
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def ca_cert_hash(ca_pem: bytes) -> str:
    """The pin of the first certificate in ``ca_pem``; ValueError when it holds none."""
    try:
        cert = x509.load_pem_x509_certificates(ca_pem)[0]
    except (ValueError, IndexError) as e:
        raise ValueError(f"the cluster CA is not a PEM certificate: {e}") from None
    return spki_hash(cert)
