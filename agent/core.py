"""The agent's work, free of any transport: the gRPC service, the status reporter and the
prefetcher all call this (docs/agent-store.md, docs/csi.md). Invariants:

* one pull per (repository, digest, credentials) at a time (later callers join it; the store's
  digest lock makes it one download per digest), at most ``max_pulls`` at once; a caller never
  blocks past ``wait_seconds``: a pull still running or queued answers PULLING;
* content is handed out per (registry, repository, digest, credentials): only once the named
  repository has served that digest's manifest to a request with the credentials of whoever
  asked (:attr:`Agent._proofs`, proved by the store), so one tenant's credentials, or the
  node's, never serve an image another tenant or a pod author named (agent/credentials.py says
  whose credentials a request gets); pulls with different credentials never join each other;
* a volume id holds one digest at one target path (:func:`_refusal`); references are the store's
  durable ones, so they survive restarts. Refusals are :class:`Refused`, named by the status
  code a caller answers with.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.metrics import Counter, Gauge, Histogram  # not the package: accelnode/metricstext.py
from prometheus_client.registry import CollectorRegistry

from accelnode.hw.accelerators import Accelerator
from accelnode.log import kv
from accelnode.malloc import trim
from accelnode.oci import cacheformat as fmt
from accelnode.oci import errors
from accelnode.oci.manifest import inspect
from accelnode.oci.reference import DIGEST_PINNED, Reference

from . import fit
from .credentials import Chooser, Credentials, PullSecretError
from .errors import NoSpace

log = logging.getLogger("accelnode.agent")

PROOF_TTL = 300.0  # seconds a repository's answer for (digest, credentials) is taken as still true
MAX_PROOFS = 16384
# Bounds of what requests leave in memory (docs/agent-store.md, Bounds): whatever callers ask,
# ListCaches stays far below gRPC's 4 MiB message cap.
MAX_QUEUED = 256  # pulls waiting for a slot; a pull beyond is refused RESOURCE_EXHAUSTED
MAX_FAILED = 128  # failed pulls remembered for ListCaches and the node's status, latest first
FAILED_TTL = 3600.0  # seconds a failed pull is remembered
MAX_MESSAGE = 1024  # characters of a failure's message kept
MAX_REFERENCES = 1024  # volumes holding caches on this node (kubelet runs at most a few hundred pods)
# the longest value of each field a reference keeps: a volume id (the controller's PV handles
# reach 390 bytes), a kubelet target path, Kubernetes' names (DNS label for a namespace, DNS
# subdomain for a name) and UIDs
REFERENCE_FIELDS = {"volume_id": 512, "target_path": 512, "namespace": 63, "name": 253, "uid": 36}
MAX_TARGET_PATHS = 4  # target paths one GetTarget may name

# Answer.state
READY, PULLING, FAILED, INCOMPATIBLE = "READY", "PULLING", "FAILED", "INCOMPATIBLE"
# Answer.failure (FAILED only)
NOT_FOUND, REGISTRY_UNAVAILABLE, DENIED, INVALID_REFERENCE, BAD_CONTENT, INTERNAL = (
    "NOT_FOUND", "REGISTRY_UNAVAILABLE", "DENIED", "INVALID_REFERENCE", "BAD_CONTENT", "INTERNAL")
# CacheInfo.state
INSTALLED = "INSTALLED"
NO_SPACE = "NO_SPACE"  # Answer.failure: the store's file system cannot hold it

FAILURES = [
    (errors.ImageNotFound, NOT_FOUND),
    (errors.RegistryUnavailable, REGISTRY_UNAVAILABLE),
    (errors.AuthError, DENIED),
    (errors.InvalidReference, INVALID_REFERENCE),
    ((errors.IntegrityError, errors.HostileContent), BAD_CONTENT),
    (NoSpace, NO_SPACE),
]


class Refused(Exception):
    """A request the agent will not carry out; ``code`` names the status to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Answer:
    """What :meth:`Agent.ensure` says about one image (the fields of EnsureCacheResponse)."""

    state: str
    digest: str = ""
    path: str = ""  # READY: the directory to bind-mount read-only
    message: str = ""
    failure: str = ""  # FAILED only
    expected: str = ""  # INCOMPATIBLE: what the image was built for
    found: str = ""  # INCOMPATIBLE: what this node has
    size_bytes: int = 0
    kind: str = ""  # READY: the kind the image's labels declare ("" when none)


@dataclass(frozen=True)
class CacheInfo:
    """One cache of the node as :meth:`Agent.caches` lists it."""

    image: str
    digest: str
    state: str  # INSTALLED, PULLING or FAILED
    path: str = ""
    kind: str = ""
    size_bytes: int = 0
    references: tuple = ()  # the held references' metadata (dicts, as the store keeps them)
    message: str = ""
    compatible: bool = False
    targets: tuple = ()  # INSTALLED: the image's targets
    queued: bool = False  # PULLING: waiting for a free pull slot
    proof: tuple = ()  # PULLING and FAILED: the (registry, repository, digest, credentials key) pulled for


@dataclass
class Pull:
    """One background pull of one image (repository and digest) with one set of credentials."""

    image: str
    credentials: Credentials
    asked: float = field(default_factory=time.monotonic)
    started: float | None = None  # when it left the queue and began
    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None  # set when done


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.pulls = Counter("accelnode_agent_pulls", "Pulls started, by result", ["result"], registry=registry)
        self.pull_seconds = Histogram("accelnode_agent_pull_seconds", "Duration of pulls", registry=registry,
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.ensure = Counter("accelnode_agent_ensure", "EnsureCache answers, by state", ["state"],
                              registry=registry)
        self.references = Gauge("accelnode_agent_references", "Volumes holding a cache", registry=registry)
        self.pulls_in_flight = Gauge("accelnode_agent_pulls_in_flight", "Pulls running now", registry=registry)
        self.pulls_queued = Gauge("accelnode_agent_pulls_queued", "Pulls waiting for a free pull slot",
                                  registry=registry)
        self.gc_runs = Counter("accelnode_agent_gc_runs", "Watermark collections (usage passed the high watermark)",
                               registry=registry)
        self.gc_removed = Counter("accelnode_agent_gc_removed", "Caches removed by watermark collections",
                                  registry=registry)
        self.gc_bytes = Counter("accelnode_agent_gc_freed_bytes", "Cache bytes removed by watermark collections",
                                registry=registry)
        self.pulled_bytes = Counter("accelnode_agent_pulled_bytes", "Blob bytes pulled, by where they came from: "
                                    "the registry itself or a mirror (hosts.toml, --registry-mirror)", ["source"],
                                    registry=registry)


class Agent:
    def __init__(self, store, accelerators: list[Accelerator], metrics: Metrics, *, max_pulls: int = 3,
                 credentials: Chooser | None = None):
        if max_pulls < 1:
            raise ValueError("max_pulls must be at least 1")
        self.store = store
        self.max_pulls = max_pulls
        self.credentials = credentials or Chooser(store.options, None)
        self.accelerators = accelerators
        self.metrics = metrics
        self._targets = [a.target() for a in accelerators if a.arch]
        self._lock = threading.Lock()
        # reference digest -> READY/INCOMPATIBLE answer, for installed caches only (at most one
        # per installed cache: forgotten when collected)
        self._ready: dict[str, Answer] = {}
        # (registry, repository, reference digest, credentials key): a "proof" -> its pull while
        # it runs or waits (at most max_pulls + MAX_QUEUED)
        self._pulls: dict[tuple, Pull] = {}
        self._queue: collections.deque[tuple[tuple, Pull]] = collections.deque()  # waiting for a slot, FIFO
        # proof -> (image, message, when) of its latest failed pull: the MAX_FAILED latest, each for
        # FAILED_TTL (not the pull: its credentials are not kept)
        self._failed: collections.OrderedDict[tuple, tuple[str, str, float]] = collections.OrderedDict()
        self._running = 0  # pull threads (each runs queued pulls until the queue is empty)
        # (registry, repository, digest, credentials key) -> when that repository last served the
        # digest's manifest to those credentials
        self._proofs: dict[tuple, float] = {}
        # The store's durable references, mirrored: the agent is their only writer.
        self._refs: dict[str, dict] = store.references()
        store.on_served = self._count_served
        metrics.references.set(len(self._refs))
        # Called after a pull starts or ends and after a reference is taken or dropped: the
        # status reporter's cue to look again (agent/reporter.py).
        self.on_change: Callable[[], None] = lambda: None
        store.on_collect = self._collected

    # -- ensure --------------------------------------------------------------------------

    def ensure(self, image: str, wait_seconds: float, *, anonymous: bool = False,
               cache: tuple[str, str] | None = None) -> Answer:
        """Is ``image`` installed here, proved to be in its repository for the asker's credentials,
        and does it fit (READY / INCOMPATIBLE), or how is its pull going? ``anonymous``: the image
        was named by a pod author; ``cache``: the (namespace, name) of the cache object that
        named it (namespace "": a ClusterGKMCache); both choose the credentials."""
        if not image:
            raise Refused("INVALID_ARGUMENT", "image is required")
        if not DIGEST_PINNED.match(image):
            return self._answer(Answer(FAILED, failure=INVALID_REFERENCE,
                                       message=f"{image}: not a digest-pinned reference (…@sha256:<64 hex>)"))
        try:
            creds = self.credentials.choose(cache, anonymous)
            ref = Reference.parse(image)
        except PullSecretError as e:
            return self._answer(Answer(FAILED, failure=DENIED, message=f"{image}: {e}"))
        except errors.InvalidReference as e:
            return self._answer(Answer(FAILED, failure=INVALID_REFERENCE, message=str(e)))
        key = ref.digest
        proof = self._proof(ref, creds)
        answer = None
        if not creds.prove or self._proven(proof):
            answer = self._ready.get(key)
            # a hand-out is a use (LRU collection); gone (collected) means asking the store again
            if answer is None or (answer.path and not self.store.mark_used(answer.digest)):
                answer = self._from_store(key)  # None: collected meanwhile, by another process too
        if answer is None:
            pull = self._pull(proof, image, creds)
            if pull.done.wait(max(0.0, wait_seconds)):
                answer = pull.answer
            else:
                answer = Answer(PULLING, digest=key, message=f"{image}: {self._progress(pull)}")
        return self._answer(answer)

    def inspect(self, image: str, cache: tuple[str, str] | None) -> dict:
        """What ``image`` is (manifests and config, no layers: :func:`accelnode.oci.manifest.inspect`),
        asked with the credentials a request naming ``cache`` gets, and never, for a tenant,
        through a mirror as the server whose answers prove nothing (the store says which)."""
        creds = self.credentials.choose(cache)
        if creds.prove:
            self.store.check_server(image, creds.options)
        return inspect(image, creds.options, self.store.limits)

    def proof_of(self, image: str, cache: tuple[str, str] | None) -> tuple | None:
        """The (registry, repository, digest, credentials key) a request for the digest-pinned
        ``image`` naming ``cache`` is proved under; None when its credentials cannot be chosen now.
        Asked on every status pass of every node: with the namespace's pull secrets as last read
        (a pull reads them again), so that an idle fleet sends no reads (docs/scale.md)."""
        try:
            return self._proof(Reference.parse(image), self.credentials.choose(cache, fresh=False))
        except (PullSecretError, errors.InvalidReference):
            return None

    @staticmethod
    def _proof(ref: Reference, creds: Credentials) -> tuple:
        return (ref.host, ref.repository, ref.digest, creds.key)

    def proven(self) -> set[tuple]:
        """Every proof the agent holds (some repository served its digest to those credentials
        since the agent started): what a cache's status may report as its own."""
        with self._lock:
            return set(self._proofs)

    def _progress(self, pull: Pull) -> str:
        """How a pull not done is going: running for how long, or its place in the queue."""
        with self._lock:
            ahead = next((i for i, (_, p) in enumerate(self._queue) if p is pull), None)
        if ahead is not None:
            return f"queued ({ahead} ahead; at most {self.max_pulls} pulls at once)"
        return f"pull in progress for {time.monotonic() - (pull.started or pull.asked):.1f}s"

    def _answer(self, answer: Answer) -> Answer:
        self.metrics.ensure.labels(answer.state).inc()
        return answer

    def _from_store(self, key: str) -> Answer | None:
        inst = self.store.installed(key)
        if inst is None:
            self._ready.pop(key, None)
            return None
        answer = self._judge(inst)
        self._ready[key] = answer
        return answer

    def _judge(self, inst) -> Answer:
        mismatch = fit.check(inst.targets, self.accelerators)
        if mismatch:
            return Answer(INCOMPATIBLE, digest=inst.digest, expected=mismatch.expected, found=mismatch.found,
                          message=f"{inst.image}: {mismatch}")
        return Answer(READY, digest=inst.digest, path=str(inst.path), size_bytes=inst.size_bytes,
                      kind=fmt.declared_kind(inst.labels) or "")

    def _proven(self, proof: tuple, *, ever: bool = False) -> bool:
        """Whether the repository served the digest to these credentials within PROOF_TTL
        (``ever``: at all, since the agent started)."""
        at = self._proofs.get(proof)
        return at is not None and (ever or time.monotonic() - at < PROOF_TTL)

    def _prove(self, proof: tuple) -> None:
        with self._lock:
            self._proofs[proof] = time.monotonic()
            if len(self._proofs) > MAX_PROOFS:  # bounded: forget the oldest quarter
                for old in sorted(self._proofs, key=self._proofs.__getitem__)[:MAX_PROOFS // 4]:
                    del self._proofs[old]

    def _pull(self, proof: tuple, image: str, creds: Credentials) -> Pull:
        """The pull (or, for content installed already, the proof) of ``image`` with ``creds``."""
        with self._lock:
            pull = self._pulls.get(proof)
            if pull is None or pull.done.is_set():
                if self._running >= self.max_pulls and len(self._queue) >= MAX_QUEUED:
                    raise Refused("RESOURCE_EXHAUSTED", f"{image}: {len(self._queue)} pulls are waiting for one of "
                                                        f"{self.max_pulls} pull slots already; retry later")
                pull = self._pulls[proof] = Pull(image, creds)
                if self._running < self.max_pulls:
                    self._running += 1
                    threading.Thread(target=self._pull_worker, args=(proof, pull), name=f"pull-{self._running}",
                                     daemon=True).start()
                else:
                    self._queue.append((proof, pull))
                    log.info("pull queued", extra=kv(image=image, ahead=len(self._queue) - 1))
                self._count()
                self.on_change()
            return pull

    def _pull_worker(self, proof: tuple, pull: Pull) -> None:
        """Run ``pull``, then the queue's oldest until the queue is empty."""
        while True:
            self._run_pull(proof, pull)
            with self._lock:
                if not self._queue:
                    self._running -= 1
                    self._count()
                    return
                proof, pull = self._queue.popleft()
                self._count()

    def _install(self, proof: tuple, pull: Pull):
        """The store's install of ``pull.image``, proved against the named repository with the
        pull's credentials; while the registry cannot answer, a proof it gave these credentials
        earlier stands (an outage does not take mounted caches from their tenants)."""
        targets = self._targets or None
        if not pull.credentials.prove:
            return self.store.ensure(pull.image, accelerators=targets)
        try:
            return self.store.ensure(pull.image, accelerators=targets, options=pull.credentials.options)
        except errors.RegistryUnavailable:
            if not self._proven(proof, ever=True) or self.store.installed(proof[2]) is None:
                raise
            log.warning("registry unreachable: handing out installed content on an earlier proof",
                        extra=kv(image=pull.image, credentials=pull.credentials.key))
            return self.store.ensure(pull.image, accelerators=targets)

    def _count_served(self, served: dict) -> None:
        for host, nbytes in served.items():
            self.metrics.pulled_bytes.labels("registry" if host.is_registry else "mirror").inc(nbytes)

    def _count(self) -> None:
        self.metrics.pulls_in_flight.set(self._running)
        self.metrics.pulls_queued.set(len(self._queue))

    def _run_pull(self, proof: tuple, pull: Pull) -> None:
        key = proof[2]
        pull.started = time.monotonic()
        creds = pull.credentials
        log.info("pull started", extra=kv(image=pull.image, credentials=creds.key,
                                          queued_s=round(pull.started - pull.asked, 3)))
        try:
            inst = self._install(proof, pull)
        except errors.NoMatchingManifest as e:
            answer = Answer(INCOMPATIBLE, digest=key, message=str(e), expected="a platform the image index lists",
                            found=fit.describe_node(self.accelerators))
        except errors.AuthError as e:
            answer = Answer(FAILED, digest=key, failure=DENIED, message=f"{e} (pulled with {creds.whose})")
        except Exception as e:  # every failure is reported to the callers, none kills the agent
            e = self.store.no_space(e, pull.image)
            answer = Answer(FAILED, digest=key, failure=_failure(e), message=str(e)[:MAX_MESSAGE])
        else:
            answer = self._judge(inst)
            self._ready[key] = answer
            if creds.prove:  # the node's own pull asked no repository's word (mirrors may have answered)
                self._prove(proof)
        result = answer.state.lower()
        self.metrics.pulls.labels(result).inc()
        self.metrics.pull_seconds.observe(time.monotonic() - pull.started)
        log.log(logging.INFO if answer.state == READY else logging.WARNING, "pull finished",
                extra=kv(image=pull.image, credentials=creds.key, result=result, message=answer.message,
                         seconds=round(time.monotonic() - pull.started, 3)))
        pull.answer = answer
        with self._lock:
            if self._pulls.get(proof) is pull:
                del self._pulls[proof]
            self._failed.pop(proof, None)
            if answer.state == FAILED:
                self._failed[proof] = (pull.image, answer.message, time.monotonic())
            self._expire_failed()
        pull.done.set()
        self.on_change()
        trim()  # the pull's buffers, freed, go back to the kernel (accelnode/malloc.py)

    def _expire_failed(self) -> None:
        """Forget failed pulls beyond MAX_FAILED (oldest first) or older than FAILED_TTL (under the lock)."""
        now = time.monotonic()
        while self._failed and (len(self._failed) > MAX_FAILED or now - next(iter(self._failed.values()))[2] > FAILED_TTL):
            self._failed.popitem(last=False)

    # -- disk ----------------------------------------------------------------------------

    def collect_to_watermark(self) -> list[str]:
        """The periodic check: collect unreferenced caches if usage passed the high watermark
        (under our lock, so no reference is taken meanwhile). The digests removed."""
        with self._lock:
            return [i.digest for i in self.store.collect_to_watermark()]

    def _collected(self, removed: list) -> None:
        """A watermark collection ran (periodic or before a pull): count it, forget what went."""
        self.metrics.gc_runs.inc()
        self.metrics.gc_removed.inc(len(removed))
        self.metrics.gc_bytes.inc(sum(i.size_bytes for i in removed))
        for inst in removed:
            self._ready.pop(inst.digest, None)
        if removed:
            self.on_change()

    def ensure_until_done(self, image: str, timeout: float, *,
                          cache: tuple[str, str] | None = None) -> tuple[bool, str]:
        """Ensure ``image`` for ``cache`` (its credentials and proof, as :meth:`ensure`) and wait
        for its pull to end (at most ``timeout`` seconds): (installed and fits, why not). What
        the prefetcher asks."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = self.ensure(image, 30, cache=cache)
            except Refused as e:
                return False, e.message
            if answer.state != PULLING:
                return answer.state == READY, answer.message
            if time.monotonic() > deadline:
                return False, f"{image}: pull still running after {timeout:.0f}s"

    # -- references ----------------------------------------------------------------------

    def acquire(self, volume_id: str, target_path: str, digest: str, pod: dict, *,
                cache: tuple[str, str] | None = None, exclusive: bool = False) -> None:
        """Record that ``pod`` (namespace, name, uid) holds ``digest`` through the volume published
        at ``target_path``; ``cache`` is the (namespace, name) of the cache the volume names."""
        _require(volume_id=volume_id, digest=digest, target_path=target_path)
        meta = {"volume_id": volume_id, "target_path": target_path, "namespace": pod.get("namespace", ""),
                "name": pod.get("name", ""), "uid": pod.get("uid", "")}
        _bounded(meta, "")
        if cache is not None:
            if not cache[1]:
                raise Refused("INVALID_ARGUMENT", "cache.name is required when cache is set")
            meta["cache"] = {"namespace": cache[0], "name": cache[1]}
            _bounded(meta["cache"], "cache.")
        key = holder(volume_id, target_path)
        with self._lock:
            refusal = _refusal(list(self._refs.values()), meta, digest, exclusive)
            if refusal is not None:
                raise refusal
            if key in self._refs:
                return
            if len(self._refs) >= MAX_REFERENCES:
                raise Refused("RESOURCE_EXHAUSTED", f"this node holds {len(self._refs)} volume references, the most "
                                                    "it keeps; unpublish volumes first")
            try:
                self.store.acquire(digest, key, meta)
            except errors.InvalidReference as e:
                raise Refused("INVALID_ARGUMENT", str(e)) from None
            except errors.ImageNotFound:
                raise Refused("NOT_FOUND", f"{digest} is not installed on this node") from None
            except (NoSpace, OSError) as e:
                raise self._refused(e, digest) from None
            self._refs[key] = dict(meta, digest=digest)
            self.metrics.references.set(len(self._refs))
        log.info("reference acquired", extra=kv(volume_id=volume_id, target=target_path, digest=digest,
                                                 pod=f"{meta['namespace']}/{meta['name']}"))
        self.on_change()

    def release(self, volume_id: str, target_path: str) -> bool:
        """Drop the reference of a volume at a target path; whether one was held."""
        _require(volume_id=volume_id, target_path=target_path)
        key = holder(volume_id, target_path)
        with self._lock:
            held = key in self._refs
            if held:
                try:
                    self.store.release(key)
                except (NoSpace, OSError) as e:
                    raise self._refused(e, key) from None
                del self._refs[key]
                self.metrics.references.set(len(self._refs))
        if held:
            log.info("reference released", extra=kv(volume_id=volume_id, target=target_path))
            self.on_change()
        return held

    def collect(self, digests: set[str]) -> list[str]:
        """Remove these installed digests from the store unless a volume holds one (checked by the
        store under its lock, and under ours so no reference is taken meanwhile) or a pull of it
        runs. Returns the digests removed."""
        if not digests:
            return []
        with self._lock:
            try:
                removed = self.store.gc(only=set(digests))
            except (NoSpace, OSError) as e:
                raise self._refused(e, ", ".join(sorted(digests))) from None
            for d in removed:
                self._ready.pop(d, None)
        if removed:
            self.on_change()
        return removed

    # -- listing -------------------------------------------------------------------------

    def caches(self) -> list[CacheInfo]:
        """Every installed cache with its references, then pulls running or failed."""
        # pulls first: one that ends while the store is listed then shows as installed (which
        # wins) rather than vanishing from this answer
        with self._lock:
            held = list(self._refs.values())
            self._expire_failed()
            pulls = list(self._pulls.items())
            failed = [(proof, image, message) for proof, (image, message, _) in reversed(self._failed.items())]
        refs: dict[str, list] = {}
        for meta in held:
            refs.setdefault(meta.get("digest"), []).append(meta)
        out = [CacheInfo(inst.image, inst.digest, INSTALLED, path=str(inst.path), kind=inst.kind,
                         size_bytes=inst.size_bytes, references=tuple(refs.get(inst.digest, ())),
                         compatible=fit.check(inst.targets, self.accelerators) is None, targets=tuple(inst.targets))
               for inst in self.store.list()]
        for proof, pull in pulls:
            queued = pull.started is None
            out.append(CacheInfo(pull.image, proof[2], PULLING, queued=queued,
                                 message=self._progress(pull) if queued else "", proof=proof))
        out += [CacheInfo(image, proof[2], FAILED, message=message, proof=proof) for proof, image, message in failed]
        return out

    def at_targets(self, target_paths: list[str], shown: tuple[int, int] | None = None):
        """What unpublish and volume stats ask, in one bounded answer: the references held at
        these target paths, each with the installed cache it holds (None once gone), and the
        installed cache whose directory has the identity ``shown`` (st_dev, st_ino) of a mount's
        root (None when none, or not asked)."""
        if len(target_paths) > MAX_TARGET_PATHS:
            raise Refused("INVALID_ARGUMENT", f"at most {MAX_TARGET_PATHS} target paths, not {len(target_paths)}")
        wanted = set(target_paths)
        with self._lock:
            held = [dict(m) for m in self._refs.values() if m.get("target_path") in wanted]
        try:
            return ([(m, self.store.installed(m["digest"])) for m in held],
                    self.store.with_identity(shown) if shown else None)
        except (NoSpace, OSError) as e:
            raise self._refused(e, ", ".join(target_paths)) from None

    def _refused(self, e: Exception, what: str) -> Refused:
        """A store failure as the status a caller gets: a full file system (or quota) is
        RESOURCE_EXHAUSTED naming the store's file system, anything else INTERNAL."""
        e = self.store.no_space(e, what)
        return Refused("RESOURCE_EXHAUSTED" if isinstance(e, NoSpace) else "INTERNAL", str(e))


def holder(volume_id: str, target_path: str) -> str:
    """The store's reference holder for a volume published at a target path."""
    return f"{volume_id}@{target_path}"


def _require(**fields: str) -> None:
    for name, value in fields.items():
        if not value:
            raise Refused("INVALID_ARGUMENT", f"{name} is required")


def _bounded(fields: dict, prefix: str) -> None:
    """INVALID_ARGUMENT for a field longer than any real one (REFERENCE_FIELDS, in UTF-8 bytes):
    references are kept, and listed."""
    for name, value in fields.items():
        most = REFERENCE_FIELDS.get(name)
        if most is not None and len(value.encode()) > most:
            raise Refused("INVALID_ARGUMENT", f"{prefix}{name} is {len(value.encode())} bytes long, more than {most}")


def _refusal(held: list[dict], want: dict, digest: str, exclusive: bool) -> Refused | None:
    """Why the references ``held`` forbid the wanted one, or None. An exclusive volume held at
    other target paths only is FAILED_PRECONDITION (the CSI spec's code for a single-node volume
    published at a second target); every other clash is ALREADY_EXISTS."""
    vid, target = want["volume_id"], want["target_path"]
    targets = {h.get("target_path") for h in held if h.get("volume_id") == vid}
    elsewhere = sorted(targets - {target})
    if exclusive and elsewhere and target not in targets:
        return Refused("FAILED_PRECONDITION", _one_target(vid, elsewhere[0]))
    for h in held:
        if h.get("target_path") != target:
            continue
        if h.get("volume_id") != vid:
            return Refused("ALREADY_EXISTS", f"target path {target} is already published for volume "
                                             f"{h.get('volume_id')}")
        if h.get("digest") != digest or h.get("uid") != want["uid"]:
            return Refused("ALREADY_EXISTS", f"volume {vid} is already published at {target} with "
                                             f"{h.get('digest')} for pod {h.get('namespace')}/{h.get('name')}")
    if exclusive and elsewhere:
        return Refused("ALREADY_EXISTS", _one_target(vid, elsewhere[0]))
    return None


def _one_target(vid: str, held_at: str) -> str:
    return f"volume {vid} is already published at {held_at} and its access mode allows one target"


def _failure(e: Exception) -> str:
    for kinds, failure in FAILURES:
        if isinstance(e, kinds):
            return failure
    return INTERNAL
