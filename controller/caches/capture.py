"""The capture reconciler (docs/capture.md): contributions the nodes report become a signed delta
image, offered in the cache's status or promoted into its ``spec.image``.

Per GKMCache with ``accelnode.io/capture: on`` (settings checked against the operator's
``--capture-repositories``, :mod:`accelnode.capture.settings`): the contributions its namespace's
``GKMCacheNode`` objects report (``status.captures``: state Pushed, captured on the cache's
current digest, pushed to the cache's capture repository), the latest :data:`MAX_SOURCES`, are
fetched and judged again as hostile input, merged (same key: one copy; different bytes: kept from
none, reported; a poisoned contribution: refused with its reason), pushed on top of the current
digest's layers with the namespace's lent push secret, signed with its signing Secret when it
names one, and recorded in ``status.capture`` (with Events). ``promotion: auto`` moves
``spec.image`` to the new digest when the rule holds (enough pods, signature verifies, nothing
refused or conflicting); the cache reconciler then pins, verifies against the trust policies and
the fleet pulls it as any cache. Inputs that were published already (same base, same sources)
are not published again: a steady state writes nothing.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import logging
import threading
from datetime import datetime, timezone

from cryptography.hazmat.primitives import serialization

from accelnode.capture import publish, settings as capture_settings
from accelnode.capture.reader import CaptureLimits
from accelnode.kube.client import Client, KubeError, Unreachable, custom_path, is_conflict, is_forbidden, is_not_found
from accelnode.kube.pullsecrets import PullSecretError
from accelnode.log import kv
from accelnode.oci import cacheformat as fmt
from accelnode.oci import signatures
from accelnode.oci.errors import ImageError, quoted
from accelnode.oci.manifest import inspect
from accelnode.oci.reference import Reference

from controller.caches.pinning import GROUP, VERSION, Resolver
from controller.runtime import events
from controller.runtime.reconciler import Reconciler, Result, Watch, object_key, split_key
from controller.runtime.writes import patch_status

log = logging.getLogger("accelnode.controller")

MAX_SOURCES = 64  # contributions merged into one image (the latest)
MAX_DONE = 4096  # caches whose last published inputs are remembered (until the watch shows the write)
SIGNING_KEY = "key.pem"  # the data key of a signing Secret: an unencrypted PEM EC private key
OFFERED, PROMOTED, REFUSED, FAILED = "Offered", "Promoted", "Refused", "Failed"


class _Moved(Exception):
    """The cache changed under a promotion in a way that makes it not ours to move any more;
    ``cache`` is the promotion's copy with the resourceVersion last read."""

    def __init__(self, message: str, cache: dict):
        super().__init__(message)
        self.cache = cache


def _promotion_inputs(cache: dict) -> tuple:
    """What a promotion was decided on: the image and the capture settings (annotations)."""
    notes = (cache.get("metadata") or {}).get("annotations") or {}
    return ((cache.get("spec") or {}).get("image"),
            tuple(sorted((k, v) for k, v in notes.items() if k.startswith(capture_settings.PREFIX))))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def trim_cache(obj: dict) -> dict:
    md, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    notes = {k: v for k, v in (md.get("annotations") or {}).items() if k.startswith(capture_settings.PREFIX)}
    return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
            "metadata": {**{k: md[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in md},
                         "annotations": notes},
            "spec": {k: spec[k] for k in ("image",) if k in spec},
            "status": {k: status[k] for k in ("resolvedDigest", "resolvedImage", "capture") if k in status}}


def trim_node(obj: dict) -> dict:
    md = obj.get("metadata") or {}
    captures = (obj.get("status") or {}).get("captures")
    return {"metadata": {k: md[k] for k in ("name", "namespace", "resourceVersion") if k in md},
            "status": {"captures": captures if isinstance(captures, dict) else {}}}


class CaptureReconciler(Reconciler):
    name = "gkmcache-capture"

    def __init__(self, client: Client, resolver: Resolver, rules: capture_settings.Rules, *,
                 limits: CaptureLimits = CaptureLimits()):
        self.client, self.resolver, self.rules, self.limits = client, resolver, rules, limits
        self.caches_path = custom_path(GROUP, VERSION, "gkmcaches")
        self.nodes_path = custom_path(GROUP, VERSION, "gkmcachenodes")
        self.watches = [Watch(self.caches_path, trim=trim_cache),
                        Watch(self.nodes_path, keys=self._node_changed, trim=trim_node)]
        # key -> (base, sources) last published: a node's event may arrive before the watch
        # shows our status write, and the same inputs must not be published twice
        self._done: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _node_changed(self, obj: dict) -> list[str]:
        ns = (obj.get("metadata") or {}).get("namespace")
        captures = (obj.get("status") or {}).get("captures") or {}
        return [f"{ns}/{name}" for name in captures] if ns and isinstance(captures, dict) else []

    def reconcile(self, key: str) -> Result | None:
        obj = self.cache.get(self.caches_path, key)
        if obj is None:
            return None
        try:
            wanted = capture_settings.parse(obj, self.rules)
        except capture_settings.BadSettings as e:
            self._write(obj, {"state": REFUSED, "message": str(e)})
            return None
        if wanted is None:
            return None
        ns, name = split_key(key)
        digest = (obj.get("status") or {}).get("resolvedDigest")
        image = (obj.get("spec") or {}).get("image", "")
        if not digest or (obj.get("status") or {}).get("resolvedImage") != image:
            return None  # the cache reconciler pins (this spec.image) first
        base = Reference.parse(image).pinned(digest)
        sources = self._sources(ns, name, digest, wanted.repository)
        previous = (obj.get("status") or {}).get("capture") or {}
        inputs = (base, [s[0] for s in sources])
        with self._lock:
            done = self._done.get(key)
        if not sources or (previous.get("base"), previous.get("sources")) == inputs or done == inputs:
            return None
        try:
            result = self._publish(obj, ns, base, wanted, sources)
            with self._lock:
                self._done[key] = inputs
                self._done.move_to_end(key)
                while len(self._done) > MAX_DONE:
                    self._done.popitem(last=False)
            return result
        except (ImageError, PullSecretError, OSError) as e:
            self._write(obj, {"state": FAILED, "message": f"publishing the capture failed: {quoted(e, 1000)}",
                              "base": base})
            log.warning("capture not published", extra=kv(key=key, error=str(e)))
            return Result(requeue=True)

    def _sources(self, ns: str, name: str, digest: str, repository: str) -> list[tuple[str, str, str, str]]:
        """(contribution, node, pod, time) of every Pushed contribution on ``digest`` to
        ``repository`` that the namespace's node objects report, the latest MAX_SOURCES, by time."""
        found: dict[str, tuple[str, str, str, str]] = {}
        for node in self.cache.list(self.nodes_path):
            md = node.get("metadata") or {}
            if md.get("namespace") != ns:
                continue
            for r in ((node.get("status") or {}).get("captures") or {}).get(name) or ():
                if not isinstance(r, dict) or r.get("state") != "Pushed" or r.get("base") != digest:
                    continue
                ref = r.get("contribution")
                if not isinstance(ref, str) or not ref.startswith(repository + "@sha256:"):
                    continue  # pushed before the repository changed: not this cache's any more
                found.setdefault(ref, (ref, md.get("name", ""), f"{r.get('podNamespace', '')}/{r.get('podName', '')}",
                                       str(r.get("time", ""))))
        return sorted(found.values(), key=lambda s: (s[3], s[0]))[-MAX_SOURCES:]

    def _publish(self, obj: dict, ns: str, base: str, wanted: capture_settings.Settings, sources) -> Result | None:
        _, base_options = self.resolver.credentials(ns, base)
        push_options = self._push_options(ns, wanted.push_secret)
        info = inspect(base, base_options)["manifests"]
        kind = info[0]["kind"] if len(info) == 1 else None
        if kind not in fmt.KINDS:
            self._write(obj, {"state": REFUSED, "base": base, "message": f"the base {base} is not a single-manifest "
                                                                         "cache image of a known kind"})
            return None
        pod_path = info[0]["labels"].get(fmt.POD_PATH_LABEL) or f"/cache/{fmt.CACHE_DIR[kind]}"
        contributions, refused, later = publish.fetch_within(sources, push_options, self.limits)
        for line in later:
            log.info("capture source left for a later publication", extra=kv(detail=line))
        merged = publish.merge(contributions, kind, pod_path, self.limits)
        refused += [f"{c.node} {c.pod}: {why}" for c, why in merged.refused]
        record = {"base": base, "sources": [s[0] for s in sources], "refused": [r[:2048] for r in refused][:64],
                  "conflicts": sorted(merged.conflicts)[:64], "time": _now()}
        for line in refused:
            events.record(obj, events.WARNING, "CaptureRefused", line)
        if not merged.files:
            self._write(obj, {"state": REFUSED, "message": "no valid new entry to publish", **record})
            return None
        out = publish.publish(base, merged, kind, wanted.repository, push_options, base_options=base_options)
        verified = None
        if wanted.signing_secret:
            private = self._signing_key(ns, wanted.signing_secret)
            signatures.sign_v2(out.reference, private, push_options)
            public = serialization.load_pem_private_key(private, None).public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
            verified = signatures.verify(wanted.repository, out.digest,
                                         [signatures.TrustedKey.from_pem(wanted.signing_secret, public)], push_options,
                                         formats=(signatures.V2,)).ok
        promote, why = publish.promotable(wanted.promotion, wanted.min_pods, merged, verified)
        who = merged.contributors
        record |= {"offered": out.reference, "entries": out.entries, "signed": bool(verified),
                   "pods": sorted({c.pod for c in who})[:256], "nodes": sorted({c.node for c in who})[:256]}
        if promote:
            try:
                obj = self._promote(obj, out.reference)
                events.record(obj, events.NORMAL, "CapturePromoted", f"spec.image moved to {out.reference} ({why})")
            except KubeError as e:  # e.g. a guard policy: offered instead, never published again for it
                promote, why = False, f"{why}, but moving spec.image was refused: {quoted(e, 500)}"
            except _Moved as e:  # the status says so, written to the version read
                obj, promote, why = e.cache, False, f"{why}, but not moved: {e}"
        message = (f"{out.reference}: {out.entries} new entries from {len(record['pods'])} pod(s) on "
                   f"{len(record['nodes'])} node(s); {why}")
        self._write(obj, {"state": PROMOTED if promote else OFFERED, "message": message, **record})
        events.record(obj, events.NORMAL, "CaptureOffered", message)
        log.info("capture published", extra=kv(key=object_key(obj), image=out.reference, promoted=promote,
                                               entries=out.entries, refused=len(refused)))
        return None

    PROMOTE_TRIES = 3

    def _promote(self, obj: dict, image: str) -> dict:
        """Move ``spec.image`` of the cache read as ``obj`` to ``image``; ``obj`` with the new
        resourceVersion. Each write is held to the version read; on a conflict the cache is read
        again and the write retried only if its image and capture settings are still those the
        publication was made for (a count the cache reconciler wrote, a label, meanwhile): a
        ``spec.image`` or setting the user changed meanwhile wins (:class:`_Moved`)."""
        ns, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        path = custom_path(GROUP, VERSION, "gkmcaches", ns, name)
        for attempt in range(self.PROMOTE_TRIES):
            try:
                md = self.client.request("PATCH", path, metadata_only=True, body={
                    "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                    "spec": {"image": image}}).get("metadata") or {}
                return {**obj, "metadata": {**obj["metadata"], **{k: md[k] for k in ("resourceVersion",) if k in md}}}
            except KubeError as e:
                if not is_conflict(e) or attempt == self.PROMOTE_TRIES - 1:
                    raise
            # read again by a list of one (the controller lists and watches caches; it has no get)
            found = self.client.list(custom_path(GROUP, VERSION, "gkmcaches", ns),
                                     query={"fieldSelector": f"metadata.name={name}"})["items"]
            if not found:
                raise _Moved("the cache was deleted while it was published", obj)
            now = trim_cache(found[0])
            obj, was = {**obj, "metadata": {**obj["metadata"], "resourceVersion": now["metadata"]["resourceVersion"]}}, obj
            if _promotion_inputs(now) != _promotion_inputs(was):
                raise _Moved("spec.image or the capture settings changed while it was published", obj)
        raise AssertionError("unreachable")

    def _push_options(self, ns: str, secret: str):
        if self.resolver.secrets is None:
            raise PullSecretError("the controller has no API server to read capture push secrets from")
        found = self.resolver.secrets.named(ns, secret, "capture push secret")
        return dataclasses.replace(self.resolver.options, config_file=None, anonymous=False, pull_secrets=(found,))

    def _signing_key(self, ns: str, name: str) -> bytes:
        what = f"capture signing secret {ns}/{name}"
        try:
            secret = self.client.request("GET", f"/api/v1/namespaces/{ns}/secrets/{name}")
        except KubeError as e:
            if is_forbidden(e):
                raise PullSecretError(f"the controller may not read {what}: the namespace lends it with a Role "
                                      "naming it (docs/capture.md)") from None
            raise PullSecretError(f"{what}: {'does not exist' if is_not_found(e) else e}") from None
        except Unreachable as e:
            raise PullSecretError(f"cannot read {what}: {e}") from None
        try:
            return base64.b64decode((secret.get("data") or {}).get(SIGNING_KEY, ""), validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise PullSecretError(f"{what}: data[{SIGNING_KEY}] is not base64") from None

    def _write(self, obj: dict, capture: dict) -> dict | None:
        """``status.capture`` written when it changed (its time aside); the object as written."""
        status = dict(obj.get("status") or {})
        old = status.get("capture") or {}
        if {k: v for k, v in old.items() if k != "time"} == {k: v for k, v in capture.items() if k != "time"}:
            return None
        status["capture"] = capture
        path = custom_path(GROUP, VERSION, "gkmcaches", obj["metadata"]["namespace"], obj["metadata"]["name"])
        # not held to the version read: status.capture has one writer (this reconciler, on the
        # leader) and the merge patch touches it alone, so the cache reconciler's writes meanwhile
        # (counts, a pin) must not lose the record of what was published
        md = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
        written = patch_status(self.client, path, {**obj, "metadata": md}, status)
        if capture["state"] in (REFUSED, FAILED) and not capture.get("sources"):
            events.record(obj, events.WARNING, "CaptureRefused" if capture["state"] == REFUSED else "CaptureFailed",
                          capture["message"])
        return written
