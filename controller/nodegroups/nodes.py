"""The VMs of a TPU node group as nodes: which Node is which VM, the join offer, labels and
taint, drain (docs/tpu-node-groups.md, "Join", "Label", "Delete").

* **Membership** is the instance's identity as GCE lists it in the group's MIG
  (``listManagedInstances``): the Node named as the instance, whose ``providerID`` (if it has one)
  names that same instance. A Node whose providerID names an instance it is not named as is not
  adopted: a kubelet chooses its providerID, GCE chooses the MIG's instances.
* **Labels** are the group's own set only (accelerator, chips, topology, group): nothing a VM can
  write (its ``kube-labels`` metadata) reaches its Node.
* **Join**: a RUNNING instance of the MIG (GCE's ``created-by`` names the MIG) without a Node
  gets a join token of its own (:meth:`controller.nodegroups.jointokens.JoinTokens.issue`) in its
  metadata. The token is revoked at its first use: the moment the API server has issued a
  certificate to a request made with it (a CSR whose requester is ``system:bootstrap:<id>``: the
  kubelet's TLS bootstrap), or its VM's Node exists, whichever comes first; a VM whose token was
  used gets no other. A token no waiting VM holds is revoked. The namespace holds at most the
  operator's ``maxJoinTokens`` at a time.
"""

from __future__ import annotations

import hashlib
import logging
import re

from accelnode.kube.bootstraptoken import METADATA_KEYS
from accelnode.kube.client import Client, KubeError, is_not_found, is_too_many_requests
from accelnode.log import kv

from controller.nodegroups.common import LABEL_GROUP, NODES, TAINT, TNG, Settings, short
from controller.nodegroups.compute import GCE, GCEError
from controller.nodegroups.jointokens import JoinTokens, created_at
from controller.runtime.reconciler import object_key
from controller.runtime.writes import update_if_changed, update_status

log = logging.getLogger("accelnode.controller.nodegroups")


CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
BOOTSTRAP_USER = "system:bootstrap:"  # the bootstrap-token authenticator's user: system:bootstrap:<token id>


def csr_token_id(csr: dict) -> str | None:
    """The join token id a CSR was requested with (None: not with a bootstrap token)."""
    user = (csr.get("spec") or {}).get("username") or ""
    return user.removeprefix(BOOTSTRAP_USER) if user.startswith(BOOTSTRAP_USER) else None


def mig_name_of(g: dict) -> str:
    """The group's MIG: its VMs are named ``<this>-<4 characters>`` (GCE's base instance name)."""
    md = g["metadata"]
    return f"{md['name']}-mig-{hashlib.sha256(md['uid'].encode()).hexdigest()[:8]}"


def provider_id(project: str, zone: str, instance: str) -> str:
    return f"gce://{project}/{zone}/{instance}"


def names_instance(node: dict, project: str, zone: str, instance: str) -> bool:
    """Whether ``node`` is the Node of ``instance``: named as it, and no providerID naming
    another instance."""
    pid = (node.get("spec") or {}).get("providerID")
    return node["metadata"]["name"] == instance and pid in (None, "", provider_id(project, zone, instance))


def is_group_node(g: dict, node: dict) -> bool:
    """Whether ``node`` is named as a VM of group ``g`` (``<MIG>-<4 characters>``, the names GCE
    gives the MIG's VMs) and claims no other instance: the nodes to cordon, drain and delete
    at teardown, found after a restart, labelled or not."""
    spec = g.get("spec") or {}
    name = node["metadata"]["name"]
    return bool(re.fullmatch(re.escape(mig_name_of(g)) + r"-[a-z0-9]{4}", name)) and \
        names_instance(node, spec.get("project"), spec.get("nodeLocation"), name)


class Nodes:
    """The instance-and-node half of the group reconciler. ``owner`` is the reconciler: its
    ``cache``, ``rw`` and ``_path`` (the runtime installs the cache after construction)."""

    def __init__(self, owner, client: Client, gce: GCE, settings: Settings, tokens=None):
        self.owner, self.client, self.gce, self.settings = owner, client, gce, settings
        self._tokens: JoinTokens | None = tokens  # made on first use
        self._withdrawn: set[str] = set()  # instance paths whose join metadata is known gone
        self._pending_meta: dict[str, str] = {}  # instance path -> setMetadata operation
        self._held: dict[str, str] = {}  # instance path -> the token id offered to it

    @property
    def cache(self):
        return self.owner.cache

    # -- one pass over the group's instances -----------------------------------------------------

    def sync(self, key: str, box: list, project: str, zone: str, mig: str, labels: dict):
        """Offer the join to RUNNING VMs of the group's MIG, label their Nodes, revoke tokens no
        VM waits with. ``box[0]`` is the group, replaced when its token ledger is written."""
        boot = box[0]["spec"].get("bootstrapKubernetes")
        nodes = {n["metadata"]["name"]: n for n in self.cache.list(NODES)}
        ready = reconciling = failed = 0
        problems, again, waiting = [], None, set()
        for mi in self.gce.managed_instances(project, zone, mig):
            inst = short(mi.instance) if mi.instance else mi.name
            errors = [f"{inst}: {e.code}: {e.message}" for e in mi.last_attempt.errors.errors]
            if errors and not mi.instance_status:
                failed += 1
                problems += errors
                continue
            path = f"{project}/{zone}/{inst}"
            node = nodes.get(inst)
            if node is not None and not names_instance(node, project, zone, inst):
                reconciling += 1
                problems.append(f"Node {inst} claims providerID {(node.get('spec') or {}).get('providerID')!r}, "
                                "not this instance: not adopted")
                continue
            if node is None:
                reconciling += 1
                status = mi.instance_status or "PROVISIONING"
                if boot and status == "RUNNING":
                    waiting.add(path)
                    ip, port = boot["controlPlaneIP"], self.settings.api_server_port
                    endpoint = ip if port == 6443 else (f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
                    wait, why = self._offer_join(key, box, project, zone, mig, inst, endpoint)
                    again = wait or again
                    problems += [why] if why else []
                elif status != "RUNNING":
                    problems.append(f"{inst} is {status}")
                continue
            if boot and path not in self._withdrawn:
                self._withdraw_join(key, box, project, zone, inst)
            self._label(node, labels)
            conds = (node.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds):
                ready += 1
            else:
                reconciling += 1
        held = {self._held[p] for p in waiting if p in self._held}
        self._revoke(key, box, [t for t in self._ledger(box) if t not in held])
        return {"ready": ready, "reconciling": reconciling, "failed": failed}, "; ".join(problems)[:4000], again

    # -- the join tokens' ledger -----------------------------------------------------------------

    @staticmethod
    def _ledger(box: list) -> list[str]:
        return list((box[0].get("status") or {}).get("joinTokens") or [])

    def _reserve(self, key: str, box: list, ids: list[str]) -> None:
        """Record the group's join token ids (its ledger: the only Secrets it may read or delete)."""
        g = box[0]
        written = update_status(self.client, self.owner._path(key), g, {**(g.get("status") or {}), "joinTokens": ids})
        if written is not None:
            self.owner.rw.remember(key, g, written)
            box[0] = written

    def _revoke(self, key: str, box: list, ids: list[str] | None = None) -> None:
        """Revoke the group's tokens ``ids`` (default: all of them) and drop them from its ledger."""
        ledger = self._ledger(box)
        ids = ledger if ids is None else [t for t in ids if t in ledger]
        if ids:
            self._join_tokens().revoke(key, ids)
            self._reserve(key, box, [t for t in ledger if t not in ids])
            log.info("join tokens revoked", extra=kv(group=key, bootstrap_ids=ids))

    def revoke_all(self, key: str, box: list) -> None:
        self._revoke(key, box)

    def _join_tokens(self):
        if self._tokens is None:
            cm = self.client.request("GET", "/api/v1/namespaces/kube-system/configmaps/kube-root-ca.crt")
            self._tokens = JoinTokens(self.client, ca_pem=cm["data"]["ca.crt"].encode())
        return self._tokens

    # -- instance metadata -----------------------------------------------------------------------

    def _meta_op_pending(self, project: str, zone: str, inst: str) -> bool:
        path = f"{project}/{zone}/{inst}"
        op = self._pending_meta.get(path)
        if op is None:
            return False
        if self.gce.operation("zones", project, zone, op).done:
            del self._pending_meta[path]
            return False
        return True

    def _set_items(self, project: str, zone: str, inst: str, change) -> bool:
        """Apply ``change(items) -> items`` to the instance's metadata with its fingerprint;
        a 412 (someone wrote in between) re-reads and tries again. Whether it wrote."""
        for _ in range(5):
            res = self.gce.get_instance(project, zone, inst)
            if res is None:
                return False
            items = {i.key: i.value for i in res.metadata.items}
            wanted = change(dict(items))
            if wanted == items:
                return False
            try:
                op = self.gce.set_metadata(project, zone, inst, res.metadata.fingerprint, wanted)
            except GCEError as e:
                if e.code == 412:
                    continue
                raise
            self._pending_meta[f"{project}/{zone}/{inst}"] = op
            return True
        raise GCEError(503, f"instance {inst}: metadata kept changing under five attempts (412)")

    def _offer_join(self, key: str, box: list, project: str, zone: str, mig: str, inst: str,
                    control_plane: str) -> tuple[float | None, str]:
        """Give the waiting VM ``inst`` a token of its own: (when to look again, a problem)."""
        if self._meta_op_pending(project, zone, inst):
            return 1.0, ""
        path = f"{project}/{zone}/{inst}"
        res = self.gce.get_instance(project, zone, inst)
        if res is None:
            return None, ""
        items = {i.key: i.value for i in res.metadata.items}
        # only to a VM our MIG made (GCE writes the MIG into created-by): never to another's
        if not items.get("created-by", "").endswith(f"/zones/{zone}/instanceGroupManagers/{mig}"):
            log.warning("VM not made by the group's MIG: no join token for it", extra=kv(group=key, instance=inst))
            return None, ""
        tokens, ledger = self._join_tokens(), self._ledger(box)
        tid = self._held.get(path) or (items.get(METADATA_KEYS[0]) or "").split(".", 1)[0]
        info = tokens.get(key, tid, control_plane) if tid in ledger else None
        # spent: revoked, and the VM gets no other (its kubelet has a certificate). Ids are reused,
        # so a live token counts only requests made since its Secret was (not its id's last holder's)
        if tid and self._used(tid, info.created if info is not None else None):
            self._held[path] = tid
            if tid in ledger:
                log.info("join token used: revoked", extra=kv(group=key, instance=inst, bootstrap_id=tid))
                self._revoke(key, box, [tid])
            return None, f"{inst} has used its join token; waiting for its Node"
        if tid in ledger and (info is None or not tokens.fresh(info)):
            # its unused token is gone or near its end: revoked before a new one is counted against
            # maxJoinTokens (kept, it would hold the VM's place under the cap for good)
            log.info("join token stale: revoked", extra=kv(group=key, instance=inst, bootstrap_id=tid))
            self._revoke(key, box, [tid])
            ledger, info = self._ledger(box), None
        if info is None:
            ns = box[0]["metadata"]["namespace"]
            others = [o for o in self.cache.list(TNG) if object_key(o) != key]
            in_ns = sum(len((o.get("status") or {}).get("joinTokens") or []) for o in others
                        if o["metadata"]["namespace"] == ns) + len(ledger)
            cap = self.settings.policy.max_join_tokens(ns)
            if in_ns >= cap:
                return self.settings.poll, (f"{inst} waits for a join token: namespace {ns} holds {in_ns} of its "
                                            f"{cap} (the operator's maxJoinTokens)")
            taken = {t for o in others for t in (o.get("status") or {}).get("joinTokens") or []}
            info = tokens.issue(key, control_plane, ledger, taken, lambda ids: self._reserve(key, box, ids),
                                requested=self._requested())
            log.info("join token issued", extra=kv(group=key, instance=inst, bootstrap_id=info.token_id))
        self._held[path] = info.token_id
        self._withdrawn.discard(path)
        if not tokens.signed(info):  # the bootstrap signer signs cluster-info within seconds
            return 1.0, ""
        if self._set_items(project, zone, inst, lambda items: {**items, **info.metadata_items()}):
            log.info("join metadata offered", extra=kv(group=key, instance=inst, bootstrap_id=info.token_id))
        return None, ""

    def _used(self, tid: str, since: float | None = None) -> bool:
        """Whether a certificate was issued to a request made with token id ``tid`` (``since``:
        made at or after that time, the token's Secret's creationTimestamp: the same id's
        earlier tokens' requests stay for an hour or more after they are revoked)."""
        return any(csr_token_id(c) == tid and (c.get("status") or {}).get("certificate")
                   and (since is None or created_at(c) >= since) for c in self.cache.list(CSRS))

    def _requested(self) -> dict[str, float]:
        """Token id -> when the newest certificate request made with a token of that id was made."""
        out: dict[str, float] = {}
        for c in self.cache.list(CSRS):
            tid = csr_token_id(c)
            if tid:
                out[tid] = max(out.get(tid, 0.0), created_at(c))
        return out

    def _withdraw_join(self, key: str, box: list, project: str, zone: str, inst: str) -> None:
        """The VM's Node exists: its token is spent. Revoke it and remove the join metadata."""
        path = f"{project}/{zone}/{inst}"
        if self._meta_op_pending(project, zone, inst):
            return
        spent = []

        def strip(items: dict) -> dict:
            spent.append((items.get(METADATA_KEYS[0]) or "").split(".", 1)[0])
            return {k: v for k, v in items.items() if k not in METADATA_KEYS}
        wrote = self._set_items(project, zone, inst, strip)
        held = self._held.pop(path, None)
        self._revoke(key, box, [t for t in (held, *spent) if t])
        if wrote:
            log.info("join metadata withdrawn", extra=kv(instance=inst))
            return
        self._withdrawn.add(path)

    def forget(self, g: dict) -> None:
        """Drop what is kept in memory about the group's instances (it is gone)."""
        spec = g.get("spec") or {}
        prefix = f"{spec.get('project')}/{spec.get('nodeLocation')}/{mig_name_of(g)}-"
        for d in (self._held, self._pending_meta):
            for p in [p for p in d if p.startswith(prefix)]:
                del d[p]
        self._withdrawn = {p for p in self._withdrawn if not p.startswith(prefix)}

    # -- labels ----------------------------------------------------------------------------------

    def _label(self, node: dict, labels: dict) -> None:
        """The group's labels and taint on its Node: the group's own label set, nothing else."""
        def mutate(n):
            n["metadata"].setdefault("labels", {}).update(labels)
            taints = n.setdefault("spec", {}).setdefault("taints", [])
            if not any(t.get("key") == TAINT["key"] and t.get("effect") == TAINT["effect"] for t in taints):
                taints.append(dict(TAINT))
        if update_if_changed(self.client, f"{NODES}/{node['metadata']['name']}", node, mutate) is not None:
            log.info("node labelled", extra=kv(node=node["metadata"]["name"], group=labels[LABEL_GROUP]))

    # -- drain -----------------------------------------------------------------------------------

    def drain(self, nodes: list[dict]) -> list[str]:
        """Evict the pods on ``nodes`` through the Eviction API (PodDisruptionBudgets decide);
        the pods still there."""
        left = []
        for n in nodes:
            pods = self.client.list("/api/v1/pods", query={"fieldSelector": f"spec.nodeName={n['metadata']['name']}"})
            for p in pods.get("items") or []:
                pm = p["metadata"]
                if any(r.get("kind") == "DaemonSet" for r in pm.get("ownerReferences") or []):
                    continue
                if "kubernetes.io/config.mirror" in (pm.get("annotations") or {}):
                    continue
                if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                left.append(f"{pm['namespace']}/{pm['name']}")
                if pm.get("deletionTimestamp"):
                    continue
                try:
                    self.client.request("POST", f"/api/v1/namespaces/{pm['namespace']}/pods/{pm['name']}/eviction",
                                        body={"apiVersion": "policy/v1", "kind": "Eviction",
                                              "metadata": {"name": pm["name"], "namespace": pm["namespace"]}})
                except KubeError as e:
                    if not (is_not_found(e) or is_too_many_requests(e)):  # 429: a PodDisruptionBudget says not now
                        raise
        return left
