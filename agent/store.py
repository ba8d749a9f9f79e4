"""The node's content-addressed kernel-cache store (docs/agent-store.md: layout, capacity,
collection). Invariants:

* a cache directory either exists complete and verified, or not at all: a pull stages under
  ``tmp/`` while holding the digest's lock (one download across processes), flushes, and renames
  it into ``caches/``; a failed pull removes its staging directory;
* a cache's mtime is its last use, set by the store itself (LRU collection does not depend on
  mount options);
* no collection (:class:`Capacity`, :meth:`CacheStore.collect_to_watermark`) removes a referenced
  cache or one whose pull holds its digest lock; a pull that cannot fit raises
  :class:`~agent.errors.NoSpace` before unpacking anything.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import secrets
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from accelnode import atomic
from accelnode.decode import CONFIG, MANIFEST, SMALL, read_file
from accelnode.decode import Budget as DocBudget
from accelnode.log import kv

from accelnode.oci import cacheformat as fmt
from accelnode.oci.errors import AuthError, HostileContent, ImageNotFound, IntegrityError, NoMatchingManifest
from accelnode.oci.hosts import Host
from accelnode.oci.limits import Limits
from accelnode.oci.manifest import check_index, get_manifest, read_config
from accelnode.oci.mirrors import ACCESS_FLAG, check_endpoint
from accelnode.oci.reference import DIGEST, Reference, check_digest
from accelnode.oci.registry import INDEX_TYPES, MANIFEST_TYPES, Deadline, Registry, RegistryOptions

from .errors import Busy, NoSpace, StoreCorrupt
from .extract import PATH_MAX, Budget, Entry, Layer, Refused, check_symlinks, extract_layer, merge, mkdir

log = logging.getLogger("accelnode.agent.store")
_libc = ctypes.CDLL(None, use_errno=True)
STALE_WRITE_SECONDS = 600.0  # a temporary file this old is no live write's (start-up sweep)
MAX_CACHES = 2048  # caches one store holds: ListCaches and the node's status stay bounded
# The store's own files are decoded under what the store itself writes within its Limits
# (accelnode.decode): a file changed on disk is refused by name, never parsed past that.
REFERENCE = SMALL  # refs/*.json: {"holder", "digest", "meta"}, meta a volume's publish context


def meta_budget(limits: Limits) -> DocBudget:
    """caches/*/meta.json: an image's config labels and targets (its config is at most
    ``max_config_bytes``, written with one space a level), ``max_layers`` layer digests."""
    return DocBudget(2 * limits.max_config_bytes + limits.max_layers * 128 + 64 * 1024,
                     CONFIG.max_values + limits.max_layers + 100, CONFIG.max_depth + 2)


def files_budget(limits: Limits) -> DocBudget:
    """caches/*/files.json: ``{path: [type, mode, size, sha256 or link target]}``, at most
    ``max_files`` entries (six values each) of names and link targets at most PATH_MAX bytes,
    each escaped to at most six bytes a byte."""
    return DocBudget(limits.max_files * (12 * PATH_MAX + 128) + 2, 6 * limits.max_files + 1, 3)


@dataclass(frozen=True)
class Installed:
    digest: str
    path: Path
    image: str
    kind: str
    targets: list
    size_bytes: int
    labels: dict


@dataclass(frozen=True)
class Capacity:
    """How the store keeps its file system from filling up (the agent's flags name each field)."""

    headroom_bytes: int = 0  # kept free beyond a pull's declared size (--pull-headroom)
    high_percent: float | None = None  # collect once usage passes this (--gc-high-percent); None: never
    low_percent: float = 0.0  # ... down to this (--gc-low-percent)
    min_idle_seconds: float = 0.0  # a cache used more recently than this is never collected (--gc-min-idle)


class CacheStore:
    def __init__(self, root, *, registry: RegistryOptions | None = None, limits: Limits | None = None,
                 capacity: Capacity | None = None, access_mirrors=()):
        self.root = Path(root)
        # mirror endpoints (HOST[:PORT]) the operator says enforce their registry's access: as
        # the server, their answers prove what a tenant may have (--mirror-enforces-access)
        self.access_mirrors = frozenset(check_endpoint(m) for m in access_mirrors)
        self.options = registry or RegistryOptions()
        self.limits = limits or Limits()
        self.capacity = capacity or Capacity()
        # called with the caches a watermark collection removed, after each one that ran
        self.on_collect: Callable[[list[Installed]], None] = lambda removed: None
        # called after each install that fetched blobs, failed or not, with the blob bytes read
        # from each host (accelnode.oci.hosts.Host): the registry itself or a mirror
        self.on_served: Callable[[dict], None] = lambda served: None
        for sub in ("caches", "indexes", "refs", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._clean_tmp()

    # -- queries -------------------------------------------------------------------------------

    def _dir(self, digest: str) -> Path:
        return self.root / "caches" / digest.replace(":", "-", 1)

    def installed(self, digest: str) -> Installed | None:
        check_digest(digest)
        try:
            meta = read_file(self._dir(digest) / "meta.json", meta_budget(self.limits))
        except FileNotFoundError:
            return None
        return self._from_meta(digest, meta)

    def _from_meta(self, digest: str, meta: dict) -> Installed:
        return Installed(digest, self._dir(digest) / "content", meta["image"], meta["kind"], meta["targets"],
                         meta["size_bytes"], meta["labels"])

    def list(self) -> list[Installed]:
        out = []
        for d in sorted((self.root / "caches").iterdir()):
            digest = d.name.replace("-", ":", 1)
            if not DIGEST.match(digest):
                continue  # not ours (e.g. lost+found)
            inst = self.installed(digest)
            if inst is not None:
                out.append(inst)
        return out

    # -- pulling -------------------------------------------------------------------------------

    def ensure(self, image: str, *, accelerators: list[dict] | None = None, progress=None,
               options: RegistryOptions | None = None) -> Installed:
        """Pull, verify and install ``image`` unless its manifest digest is installed already.

        ``options`` replaces the store's registry options for this pull (whoever asked: a
        tenant's pull secrets, none, the node's). Content is then handed out only once the
        repository ``image`` names has served every manifest of the chain that led to it (the
        index and the manifest chosen from it) with those options (:meth:`_granted`), so no one
        gets what other credentials fetched, nor content by naming its digest, or an index
        listing it, under a repository that does not hold it."""
        ref = Reference.parse(image)
        own = options is not None
        if ref.digest:
            found = self._installed_offline(ref.digest, image, accelerators)
            if found is not None:
                return self._granted(found, ref, options, [ref.digest], set()) if own else found
        options = options or self.options
        reg = Registry(ref.host, options, Deadline(options.timeout))
        served: set[str] = set()  # manifests the named repository's server answered in this pull

        def fetch(digest: str | None = None):
            got = get_manifest(reg, ref, image, self.limits, digest)
            if own and reg.manifests_from_server and self._proves(reg.last):
                served.add(got[3])
            return got

        if own:
            self._check_prover(reg, image)
        body, manifest, media_type, digest = fetch()
        chain = [digest]
        if media_type in INDEX_TYPES:
            desc = self._choose(manifest, image, accelerators)  # a refused index is not kept
            self._save_index(digest, body)
            found = self._use(desc["digest"])
            if found is not None:
                return self._granted(found, ref, options, chain, served) if own else found
            _, manifest, media_type, digest = fetch(desc["digest"])
            chain.append(digest)
        if media_type not in MANIFEST_TYPES:
            raise HostileContent(f"unsupported manifest media type {media_type!r}", image)
        found = self._use(digest)
        if found is None:
            with self._digest_lock(digest, image, reg.deadline):
                found = self._use(digest)  # another thread or process may have installed it meanwhile
                if found is None:
                    found = self._install(reg, ref, image, digest, manifest, progress)
        return self._granted(found, ref, options, chain, served) if own else found

    def _granted(self, found: Installed, ref: Reference, options: RegistryOptions, chain: list[str],
                 served: set[str]) -> Installed:
        """``found`` for a pull with options of its own, once ``ref``'s repository has served,
        with them, every manifest of ``chain`` (the digest named, and the manifest an index led
        to: ``found``) (``served``: those its server just answered) and, when the content was
        installed from another registry, that one has served ``found``'s manifest too: anyone may
        put a copy of a private manifest (not of its blobs) in a registry of theirs and name it,
        or list it in an index of theirs. Within one registry a repository serves a manifest
        only with its blobs, so the named repository's answer is proof enough."""
        for digest in dict.fromkeys([*chain, found.digest]):
            if digest not in served:
                self._holds(ref, digest, options, str(ref), f"{ref.host}/{ref.repository}")
        origin = Reference.parse(found.image)
        if origin.host != ref.host:  # never named to this caller: it may not know that repository
            self._holds(origin, found.digest, options, str(ref), "the registry this node installed it from")
        return found

    def _holds(self, repo: Reference, digest: str, options: RegistryOptions, image: str, what: str) -> None:
        """Raise AuthError unless ``repo``'s repository serves manifest ``digest`` with ``options``
        (a GET of the server alone, its body checked against the digest). Neither its absence nor
        a refusal is told apart in the message: both say only that this pull may not have it."""
        reg = Registry(repo.host, options, Deadline(options.timeout), only_server=True)
        self._check_prover(reg, image)
        try:
            get_manifest(reg, Reference(repo.host, repo.repository, digest=digest), image, self.limits)
        except (AuthError, ImageNotFound):
            raise AuthError(f"{what} does not serve {digest} to this pull "
                            f"({'anonymous' if options.anonymous else 'with its credentials'}); content installed "
                            "on this node is handed out only to a pull its repository serves", image) from None

    def _proves(self, server: Host) -> bool:
        """Whether ``server``'s answers say who may have a digest: the registry itself, or a
        mirror the operator said enforces the registry's access (--mirror-enforces-access)."""
        return server.is_registry or server.netloc in self.access_mirrors

    def check_server(self, image: str, options: RegistryOptions) -> None:
        """:meth:`_check_prover` for a tenant's request about ``image`` that is not a pull (the
        prefetcher's look at an image's manifests)."""
        self._check_prover(Registry(Reference.parse(image).host, options), image)

    def _check_prover(self, reg: Registry, image: str) -> None:
        """AuthError, before any request, when ``reg``'s server is a mirror whose answers prove
        nothing about a tenant (a pull-through cache serves anyone who reaches it)."""
        server = reg.last
        if not self._proves(server):
            raise AuthError(f"the requests of registry {reg.host} go to mirror {server.netloc} as their server "
                            f"({server.source}), and a mirror's answer does not prove that this pull may have the "
                            "image (a pull-through cache serves anyone who reaches it): nothing is pulled or handed "
                            "out with a tenant's credentials through it. If that mirror enforces the registry's own "
                            f"access control, the operator says so with {ACCESS_FLAG} {server.netloc}", image)

    def _installed_offline(self, digest: str, image: str, accelerators) -> Installed | None:
        found = self._use(digest)
        if found is None:
            try:
                index = read_file(self._index_path(digest), MANIFEST.bytes(self.limits.max_manifest_bytes))
            except FileNotFoundError:
                return None
            found = self._use(self._choose(index, image, accelerators)["digest"])
        return found

    def _choose(self, index: dict, image: str, accelerators) -> dict:
        check_index(index, image, self.limits)
        desc = fmt.choose_manifest(index, accelerators)
        if desc is None:
            offered = [(d.get("platform"), (d.get("annotations") or {}).get(fmt.TARGETS_ANNOTATION))
                       for d in index.get("manifests") or [] if isinstance(d, dict) and isinstance(d.get("annotations") or {}, dict)]
            raise NoMatchingManifest(f"image index has no manifest for this node (platform {fmt.host_platform()}, "
                                     f"accelerators {accelerators or []}); it offers {offered}", image)
        if desc.get("mediaType") not in MANIFEST_TYPES:
            raise HostileContent(f"index entry has unsupported media type {desc.get('mediaType')!r}", image)
        check_digest(desc.get("digest"), image)
        return desc

    def _install(self, reg: Registry, ref: Reference, image: str, digest: str, manifest: dict, progress) -> Installed:
        try:
            return self._install_blobs(reg, ref, image, digest, manifest, progress)
        finally:
            if reg.served:
                self.on_served(dict(reg.served))

    def _install_blobs(self, reg: Registry, ref: Reference, image: str, digest: str, manifest: dict,
                       progress) -> Installed:
        layers, kind, targets, labels = read_config(reg, ref, manifest, image, self.limits)
        need = declared_size(layers, kind, labels)
        self.make_room(need, image, stated=stated_size(kind, labels))
        started = time.monotonic()
        try:
            stage = Path(tempfile.mkdtemp(prefix=digest.split(":")[1] + ".", dir=self.root / "tmp"))
        except OSError as e:
            raise self._full(e, need, image) from None
        try:
            base = self._extract_from_hosts(reg, ref, image, layers, stage / "layers", progress)
            content = stage / "content"
            os.rename(base.root, content)
            kind = kind or fmt.detect_kind(content)
            if kind is None:
                raise HostileContent("not a kernel-cache image: no cache.<kind>.image/summary label and no "
                                     "single io.<kind>.cache/ tree", image)
            size = sum(e.size for e in base.entries.values() if e.type == "file")
            atomic.write(stage / "files.json", json.dumps({p: e.as_json() for p, e in sorted(base.entries.items())}),
                         durable=False)  # the whole stage is flushed at once below
            meta = {"digest": digest, "image": image, "kind": kind, "targets": targets, "size_bytes": size,
                    "labels": labels, "layers": [d["digest"] for d in layers], "installed_at": time.time()}
            atomic.write(stage / "meta.json", json.dumps(meta, indent=1), durable=False)
            shutil.rmtree(stage / "layers")
            _sync_tree(stage)
            os.rename(stage, self._dir(digest))
            atomic.fsync_dir(self.root / "caches")
        except BaseException as e:
            shutil.rmtree(stage, ignore_errors=True)
            if isinstance(e, OSError):
                raise self._full(e, need, image) from None
            raise
        log.info("cache installed", extra=kv(image=image, digest=digest, kind=kind, bytes=size,
                                             layers=len(layers), seconds=round(time.monotonic() - started, 3),
                                             blob_bytes_from={str(h): n for h, n in reg.served.items()}))
        return self._from_meta(digest, meta)

    def _extract_from_hosts(self, reg: Registry, ref: Reference, image: str, layers: list[dict], where: Path,
                            progress) -> Layer:
        """:meth:`_extract_all`, once more from the server alone when content a mirror sent part
        of was refused as hostile: limits are shared by the layers of an image, and a layer a
        mirror corrupts counts against them until its digest fails, so a sound layer beside it
        may be refused for what the mirror sent (docs/registries.md, Failures)."""
        where.mkdir()
        try:
            return self._extract_all(reg, ref.repository, image, layers, where, progress)
        except HostileContent as e:
            if all(h == reg.last for h in reg.served):
                raise
            log.warning("content refused after a mirror served part of it; pulling it again from the server alone",
                        extra=kv(image=image, problem=e.detail, mirrors=[str(h) for h in reg.served if h != reg.last]))
        shutil.rmtree(where)
        where.mkdir()
        server = Registry(ref.host, reg.options, reg.deadline, only_server=True)
        try:
            return self._extract_all(server, ref.repository, image, layers, where, progress)
        finally:
            for h, n in server.served.items():
                reg.served[h] = reg.served.get(h, 0) + n

    def _extract_all(self, reg, repository, image, layers, where: Path, progress) -> Layer:
        """Download and unpack every layer in parallel, then merge them in order."""
        budget = Budget(self.limits)
        if progress is not None:
            progress.start(sum(d["size"] for d in layers), image)

        def one(i: int, desc: dict) -> Layer:
            try:
                return reg.verified(lambda exclude: attempt(i, desc, exclude), image)
            except BaseException:
                budget.cancelled.set()
                raise

        def attempt(i: int, desc: dict, exclude) -> Layer:
            """Layer ``i`` from the first host not in ``exclude``; when its bytes fail their
            digest, what it unpacked and charged is undone so that the next host can be tried."""
            charged = budget.attempt()
            dest = where / str(i)
            if dest.exists():
                shutil.rmtree(dest)
            with reg.open_blob(repository, desc, image, exclude=exclude) as blob:
                if progress is not None:
                    blob.on_read = progress.advance
                try:
                    try:
                        return extract_layer(blob, fmt.LAYER_TYPES[desc["mediaType"]], dest, charged)
                    except Refused as e:
                        if not budget.cancelled.is_set():
                            blob.drain()  # bytes that do not match their digest are the real problem
                        raise HostileContent(f"layer {i} ({desc['digest']}): {e}", image) from None
                except IntegrityError:
                    charged.refund()
                    raise

        with ThreadPoolExecutor(max_workers=min(len(layers), 8) or 1) as pool:
            futures = [pool.submit(one, i, d) for i, d in enumerate(layers)]
            errors = []
            for f in futures:
                if f.exception() is not None:
                    budget.cancelled.set()
                    errors.append(f.exception())
        # the first real error, not a "cancelled" echo of it in another layer
        if errors:
            raise next((e for e in errors if "cancelled:" not in str(e)), errors[0])
        if progress is not None:
            progress.finish()
        if not layers:
            mkdir(where / "empty")
            return Layer(where / "empty")
        base, *rest = [f.result() for f in futures]
        for i, upper in enumerate(rest, 1):
            try:
                merge(base, upper)
            except Refused as e:
                raise HostileContent(f"layer {i} ({layers[i]['digest']}): {e}", image) from None
        try:
            check_symlinks(base.entries)
        except Refused as e:
            raise HostileContent(str(e), image) from None
        return base

    # -- space -------------------------------------------------------------------------------

    def usage(self) -> tuple[int, int, int]:
        """(used, total, available) bytes of the store's file system, as ``df`` counts them."""
        st = os.statvfs(self.root)
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize

    def make_room(self, need: int, image: str, *, stated: int | None = None) -> None:
        """Before a pull of ``need`` bytes (what the image declares, which nothing checked): refuse
        with :class:`NoSpace` before anything is collected when the store cannot hold it (beyond
        --max-image-size, or beyond its file system's free space plus what collection may remove,
        keeping the headroom); else collect only what makes the room (down to the low watermark
        when the pull passes the high one), and refuse if it still does not fit. ``stated``: the
        content bytes the image's label states, held to --max-image-size (``need`` also counts
        compressed layers, whose tar headers and incompressible data may exceed the content)."""
        headroom = self.capacity.headroom_bytes
        if (stated or 0) > self.limits.max_bytes or need > self.limits.max_tar_bytes:
            need = max(stated or 0, need)
            raise NoSpace(f"the image declares {_mib(need)}, beyond the {_mib(self.limits.max_bytes)} this store "
                          "takes of one image (--max-image-size); nothing was collected", image)
        _, total, free = self.usage()
        caches, removable = self._removable(idle=self.capacity.min_idle_seconds)
        if self.capacity.high_percent is None:
            removable = []
        if len(caches) >= MAX_CACHES:
            if len(caches) - len(removable) >= MAX_CACHES:
                why = ("watermark collection is off" if self.capacity.high_percent is None
                       else "too few of them may be collected (unreferenced and idle for --gc-min-idle)")
                raise NoSpace(f"the store holds {len(caches)} caches, the most it keeps ({MAX_CACHES}), and {why}; "
                              "nothing was collected", image)
            self.on_collect(self._collect(None, None, self.capacity.min_idle_seconds, max_count=MAX_CACHES - 1))
        collectable = sum(i.size_bytes for i in removable)
        if need + headroom > free + collectable:
            how = (f"collecting every unreferenced cache idle for --gc-min-idle would free {_mib(collectable)} "
                   "more, so nothing was collected" if self.capacity.high_percent is not None
                   else "watermark collection is off")
            raise NoSpace(f"no space left on device for this image: it declares {_mib(need)} and the store's file "
                          f"system ({self.root}, {_mib(total)}) has {_mib(free)} free, keeping {_mib(headroom)} "
                          f"spare (--pull-headroom); {how}", image)
        self.collect_to_watermark(need, at_least=need + headroom - free)
        _, _, free = self.usage()
        if need + headroom > free:  # a cache was referenced or used meanwhile, or others wrote
            raise NoSpace(f"no space left on device for this image: it declares {_mib(need)} and the store's file "
                          f"system ({self.root}) has {_mib(free)} free after collection, keeping {_mib(headroom)} "
                          "spare (--pull-headroom)", image)


    def collect_to_watermark(self, need: int = 0, *, at_least: int = 0) -> list[Installed]:
        """When usage plus ``need`` bytes passes the high watermark, remove unreferenced caches,
        least recently used first, until it is under the low watermark, and at least ``at_least``
        bytes (or nothing removable is left). The caches removed; :attr:`on_collect` hears of
        every run."""
        cap = self.capacity
        used, total, _ = self.usage()
        passed = total and (used + need) * 100 > (cap.high_percent or 0) * total
        if cap.high_percent is None or not total or (not passed and at_least <= 0):
            return []
        excess = max(used + need - cap.low_percent * total / 100 if passed else 0, at_least)
        cached = sum(i.size_bytes for i in self.list())
        removed = self._collect(max(0, int(cached - excess)), None, idle=cap.min_idle_seconds)
        log.info("watermark collection", extra=kv(used=used, total=total, need=need, removed=len(removed),
                                                  bytes=sum(i.size_bytes for i in removed)))
        self.on_collect(removed)
        return removed

    def _full(self, e: OSError, need: int, image: str) -> Exception:
        """A failed install's OSError, in plain words when the disk filled up."""
        if not _is_full(e):
            return e
        return NoSpace(f"no space left on device in the store's file system ({self.root}) while unpacking "
                       f"(the image declares {_mib(need)}, which under-states it or others wrote meanwhile); "
                       "nothing of it was kept", image)

    def no_space(self, e: Exception, what: str) -> Exception:
        """``e`` as :class:`NoSpace` naming the store's file system when the file system (or a
        quota) is full; any other error as it is. A full disk is bad input, never a crash."""
        if not _is_full(e):
            return e
        return NoSpace(f"no space left on device in the store's file system ({self.root}): {e.strerror}; "
                       "nothing was changed", what)

    def with_identity(self, ident: tuple[int, int]) -> Installed | None:
        """The installed cache whose content directory has ``ident`` (st_dev, st_ino), or None:
        one stat per installed cache, no file read."""
        for d in (self.root / "caches").iterdir():
            digest = d.name.replace("-", ":", 1)
            try:
                st = os.stat(d / "content", follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if (st.st_dev, st.st_ino) == tuple(ident) and DIGEST.match(digest):
                return self.installed(digest)
        return None

    # -- references ----------------------------------------------------------------------------

    def _ref_path(self, holder: str) -> Path:
        if not holder:
            raise ValueError("a reference needs a holder")
        return self.root / "refs" / (hashlib.sha256(holder.encode()).hexdigest()[:40] + ".json")

    def acquire(self, digest: str, holder: str, meta: dict) -> None:
        check_digest(digest)
        with self._store_lock():
            if self._use(digest) is None:
                raise ImageNotFound("not installed in the store", digest)
            atomic.write(self._ref_path(holder), json.dumps({"holder": holder, "digest": digest, "meta": meta}))

    def release(self, holder: str) -> None:
        with self._store_lock():
            path = self._ref_path(holder)
            try:
                digest = read_file(path, REFERENCE)["digest"]
                path.unlink()
            except FileNotFoundError:
                return
            atomic.fsync_dir(self.root / "refs")
            self._use(digest)  # used until now: the last to go among the unreferenced

    def references(self) -> dict[str, dict]:
        out = {}
        for p in sorted((self.root / "refs").glob("*.json")):
            try:
                doc = read_file(p, REFERENCE)
                out[doc["holder"]] = {**doc["meta"], "digest": check_digest(doc["digest"])}
            except FileNotFoundError:
                continue
            except (ValueError, KeyError, TypeError) as e:  # InvalidReference is a ValueError too
                raise StoreCorrupt(f"reference file {p} is unreadable ({type(e).__name__}: {e}); "
                                   "refusing to guess what is in use") from None
        return out

    # -- maintenance ---------------------------------------------------------------------------

    def verify(self, digest: str | None = None) -> list[str]:
        """Re-hash installed content against what was recorded at install; problems found."""
        if digest is not None and self.installed(digest) is None:
            raise ImageNotFound("not installed in the store", digest)
        todo = [digest] if digest else [i.digest for i in self.list()]
        problems = []
        for d in todo:
            try:
                want = {p: Entry.from_json(v)
                        for p, v in read_file(self._dir(d) / "files.json", files_budget(self.limits)).items()}
            except (OSError, ValueError) as e:
                problems.append(f"{d}: file list unreadable: {e}")
                continue
            have = _scan(self._dir(d) / "content")
            for path in sorted(want.keys() | have.keys()):
                w, h = want.get(path), have.get(path)
                if h is None:
                    problems.append(f"{d}: {path}: missing")
                elif w is None:
                    problems.append(f"{d}: {path}: not part of the image")
                elif w != h:
                    same_file = w.type == h.type == "file"
                    what = "content" if same_file and (w.sha256, w.size) != (h.sha256, h.size) else "type, mode or target"
                    problems.append(f"{d}: {path}: {what} changed")
        return problems

    def gc(self, max_bytes: int | None = None, *, only: set[str] | None = None) -> list[str]:
        """Remove unreferenced caches, least recently used first, until at most ``max_bytes``
        remain (all unreferenced ones when ``max_bytes`` is None); with ``only``, none but those
        digests. A cache being pulled is skipped. Returns digests removed."""
        return [i.digest for i in self._collect(max_bytes, only)]

    def _removable(self, only: set[str] | None = None, idle: float = 0.0) -> tuple[list[Installed], list[Installed]]:
        """(every installed cache (of ``only``), those a collection may remove, least recently
        used first): unreferenced, and with ``idle`` not used within that many seconds (a cache
        just handed out is about to be referenced by the volume that asked for it)."""
        referenced = {r["digest"] for r in self.references().values()}
        caches = [i for i in self.list() if only is None or i.digest in only]
        used = {}
        for i in caches:
            try:
                used[i.digest] = self._dir(i.digest).stat().st_mtime
            except FileNotFoundError:  # removed meanwhile by another process
                continue
        recent = time.time() - idle
        return caches, sorted((i for i in caches if i.digest in used and i.digest not in referenced
                               and not (idle and used[i.digest] > recent)), key=lambda i: used[i.digest])

    def _collect(self, max_bytes: int | None, only: set[str] | None, idle: float = 0.0, *,
                 max_count: int | None = None) -> list[Installed]:
        """:meth:`gc`'s work, down to ``max_bytes`` and ``max_count`` caches (None: no bound);
        ``idle`` as in :meth:`_removable`."""
        removed, trash = [], []
        with self._store_lock():
            caches, removable = self._removable(only, idle)
            total, count = sum(i.size_bytes for i in caches), len(caches)
            for inst in removable:
                if (max_bytes is None or total <= max_bytes) and (max_count is None or count <= max_count) \
                        and (max_bytes is not None or max_count is not None):
                    break
                try:
                    with self._digest_lock(inst.digest, inst.digest, None):
                        # a rename needs no new block: a collection works on a full file system too
                        trash.append(self.root / "tmp" / f"trash.{secrets.token_hex(8)}")
                        os.rename(self._dir(inst.digest), trash[-1])
                        atomic.fsync_dir(self.root / "caches")
                except Busy:
                    continue
                total -= inst.size_bytes
                count -= 1
                removed.append(inst)
                log.info("cache removed", extra=kv(digest=inst.digest, bytes=inst.size_bytes))
        for t in trash:  # the slow part, outside the store lock (leftovers go at the next start)
            shutil.rmtree(t, ignore_errors=True)
        return removed

    # -- locks and housekeeping ---------------------------------------------------------------

    @contextmanager
    def _flock(self, path: Path, what: str, deadline: Deadline | None):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is None or deadline.remaining() <= 0:
                        raise Busy(f"{what} is held by another operation") from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    def _digest_lock(self, digest: str, image: str, deadline: Deadline | None):
        return self._flock(self.root / "locks" / (digest.split(":")[1] + ".lock"), f"{image}: the pull of {digest}",
                           deadline)

    def _store_lock(self):
        return self._flock(self.root / "locks" / "store.lock", "the store", Deadline(30.0))

    def _clean_tmp(self) -> None:
        for p in (self.root / "tmp").iterdir():
            digest_hex = p.name.split(".")[0]
            if p.name.startswith("trash.") or not DIGEST.match(f"sha256:{digest_hex}"):
                _remove_any(p)
                continue
            try:
                with self._digest_lock(f"sha256:{digest_hex}", p.name, None):
                    _remove_any(p)
                    log.info("removed leftovers of an interrupted pull", extra=kv(path=str(p)))
            except Busy:
                pass  # a pull in another process is using it
        # a write killed half-way: references are written under the store lock only, indexes
        # under none (so only a temporary far older than one write is a leftover)
        with self._store_lock():
            stale = atomic.sweep(self.root / "refs")
        stale += atomic.sweep(self.root / "indexes", min_age=STALE_WRITE_SECONDS)
        for p in stale:
            log.info("removed the temporary file of an interrupted write", extra=kv(path=str(p)))

    def _index_path(self, digest: str) -> Path:
        return self.root / "indexes" / (digest.replace(":", "-", 1) + ".json")

    def _save_index(self, digest: str, body: bytes) -> None:
        path = self._index_path(digest)
        if not path.exists():
            atomic.write(path, body, durable=False)

    def mark_used(self, digest: str) -> bool:
        """Record a use of an installed cache now (its last use, for LRU); False if it is gone."""
        try:
            os.utime(self._dir(digest))
            return True
        except FileNotFoundError:
            return False

    def _use(self, digest: str) -> Installed | None:
        """The installed cache, its last use (directory mtime, for LRU) set to now; None if absent."""
        inst = self.installed(digest)
        if inst is not None and not self.mark_used(digest):  # removed by gc just now
            return None
        return inst


def stated_size(kind: str | None, labels: dict) -> int | None:
    """The content bytes an image's ``cache-size-bytes`` label states (None: no usable label)."""
    label = labels.get(fmt.label(kind, "cache-size-bytes"), "") if kind else ""
    if not (isinstance(label, str) and label.isascii() and label.isdigit()):
        return None
    return int(label) if len(label) <= 20 else 10 ** 20  # more than any disk either way


def declared_size(layers: list[dict], kind: str | None, labels: dict) -> int:
    """What a pull will need on disk, as the image says: its ``cache-size-bytes`` label, and at
    least the sum of its layer sizes (an image may under-state it: unpacking then stops cleanly
    at a full disk)."""
    return max(sum(d["size"] for d in layers), stated_size(kind, labels) or 0)


def _is_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _scan(root: Path) -> dict[str, Entry]:
    """The tree under ``root`` as Entries (hashing every file); never follows symlinks."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirs + files:
            path = name if rel == "." else f"{rel}/{name}"
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                out[path] = Entry("dir", mode)
            elif stat.S_ISLNK(st.st_mode):
                out[path] = Entry("symlink", 0o777, target=os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(full, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                out[path] = Entry("file", mode, st.st_size, h.hexdigest())
            else:
                out[path] = Entry("special", mode)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
    return out


def _remove_any(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sync_tree(path: Path) -> None:
    """Flush a freshly written tree: one syncfs of its file system (far cheaper than an fsync
    per file), falling back to sync()."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
