"""The VM's metadata server, as Google's own clients reach it (docs/bootstrap.md).

The server is ``GCE_METADATA_HOST`` (``host[:port]``; Google's Go and Python clients honour the
same variable) or ``169.254.169.254``. Every request carries ``Metadata-Flavor: Google`` and an
answer without it is refused (something else answered at that address). :meth:`Metadata.get`
reads a path once; :meth:`Metadata.watch` long-polls it (``wait_for_change=true`` with the
``last_etag`` of the previous answer and a ``timeout_sec``), so a change is seen the moment it
happens instead of at the next poll. To wait for an attribute to *appear*, watch the attributes
directory (:meth:`Metadata.attributes`): the server answers a missing key with 404 at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import urllib3

from accelnode.decode import METADATA, DocumentError, decode

DEFAULT_HOST = "169.254.169.254"
PREFIX = "/computeMetadata/v1/"
HOST_ENV = "GCE_METADATA_HOST"
READ_SLACK = 10.0  # seconds a long poll's read timeout exceeds its timeout_sec


class MetadataError(Exception):
    """The metadata server refused or could not be reached (the message says which)."""


class Unreachable(MetadataError):
    """No answer (connection refused, reset, timed out) or a 5xx: worth retrying."""


class NotFound(MetadataError):
    pass


@dataclass(frozen=True)
class Answer:
    body: str
    etag: str | None


def metadata_host(environ=os.environ) -> str:
    return (environ.get(HOST_ENV) or DEFAULT_HOST).strip()


class Metadata:
    def __init__(self, host: str | None = None, *, timeout: float = 10.0):
        self.host = host or metadata_host()
        if "/" in self.host or not self.host:
            raise ValueError(f"metadata host {self.host!r} is not host[:port]")
        self.timeout = timeout
        self._http = urllib3.PoolManager(num_pools=1, maxsize=2, retries=False)

    def _get(self, path: str, query: dict, read_timeout: float) -> Answer:
        url = f"http://{self.host}{PREFIX}{path}"
        try:
            resp = self._http.request("GET", url, fields=query or None, headers={"Metadata-Flavor": "Google"},
                                      timeout=urllib3.Timeout(connect=self.timeout, read=read_timeout),
                                      redirect=False, preload_content=False)
            data = resp.read(METADATA.max_bytes + 1)  # what the server sends past its budget is never read
            resp.release_conn() if len(data) <= METADATA.max_bytes else resp.close()
        except urllib3.exceptions.HTTPError as e:
            raise Unreachable(f"metadata server {self.host}: {e}") from None
        if resp.headers.get("Metadata-Flavor") != "Google":
            raise MetadataError(f"{url}: the answer (HTTP {resp.status}) lacks Metadata-Flavor: Google; "
                                f"is {self.host} a metadata server?")
        if resp.status == 404:
            raise NotFound(f"{path}: not in the metadata")
        if resp.status >= 500:
            raise Unreachable(f"{url}: HTTP {resp.status}")
        if resp.status != 200:
            raise MetadataError(f"{url}: HTTP {resp.status}: {data[:200].decode(errors='replace').strip()}")
        if len(data) > METADATA.max_bytes:
            raise MetadataError(f"{url}: the answer is over {METADATA.max_bytes // 2**20} MiB")
        return Answer(data.decode(errors="replace"), resp.headers.get("ETag"))

    def get(self, path: str, *, recursive: bool = False) -> Answer:
        """One read of ``path`` (relative to ``/computeMetadata/v1/``)."""
        return self._get(path, {"recursive": "true"} if recursive else {}, self.timeout)

    def watch(self, path: str, *, last_etag: str | None, timeout_sec: int = 60, recursive: bool = False) -> Answer:
        """``path`` once it differs from ``last_etag`` (at once if it already does), or as it is
        after ``timeout_sec`` seconds."""
        query = {"wait_for_change": "true", "timeout_sec": str(int(timeout_sec))}
        if last_etag:
            query["last_etag"] = last_etag
        if recursive:
            query["recursive"] = "true"
        return self._get(path, query, timeout_sec + READ_SLACK)

    def attributes(self, *, last_etag: str | None = None, wait: bool = False,
                   timeout_sec: int = 60) -> tuple[dict[str, str], str | None]:
        """The instance's custom attributes and their directory's ETag; with ``wait``, once
        they changed from ``last_etag``."""
        path = "instance/attributes/"
        a = (self.watch(path, last_etag=last_etag, timeout_sec=timeout_sec, recursive=True) if wait
             else self.get(path, recursive=True))
        try:
            attrs = decode(a.body, METADATA, path)
        except DocumentError as e:
            raise MetadataError(str(e)) from None
        return {str(k): str(v) for k, v in attrs.items()}, a.etag

    def close(self) -> None:
        self._http.clear()


def kube_labels(value: str) -> dict[str, str]:
    """The ``kube-labels`` attribute (``k=v,k2=v2``: the Node labels GKE and our node groups give a
    VM before it joins) as a dict; malformed pairs skipped."""
    out = {}
    for pair in (value or "").split(","):
        k, sep, v = pair.strip().partition("=")
        if sep and k:
            out[k] = v
    return out
