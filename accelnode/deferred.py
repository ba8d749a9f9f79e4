"""Modules the node daemons import only because a library does, run at their first use instead.

Every module a process imports stays resident in it. Some come with libraries the daemons need
while the daemons never use them (:data:`DEFERRED`):

* ``asyncio`` and ``grpc.aio``: grpc imports them for its asyncio API every time it is imported;
  the node daemons serve and call gRPC with threads (about 45 modules);
* ``google.protobuf.internal.python_message`` (and ``text_format`` and the rest it imports):
  protobuf's pure-Python message classes, imported by its descriptor pool and builder even where
  the upb C extension, as here, makes every message;
* ``html``: ``http.server`` escapes its error pages with it (the metrics server's 404s only);
* ``calendar``: imported for dates in mail headers and cookies that the daemons do not parse;
* ``urllib3.http2``: its package only (it imports ``importlib.metadata`` to check for the ``h2``
  package, which the daemons do not use; urllib3 itself imports only ``urllib3.http2.probe``).
* ``prometheus_client``: its package only, which imports its HTTP servers, push gateway client and
  default collectors (``prometheus_client.exposition``: wsgiref, urllib.request, gzip, platform ...);
  the daemons take the metric classes from ``prometheus_client.metrics`` and ``.registry`` and write
  the text format themselves (accelnode/metricstext.py).
* ``idna``: IDNA 2008 host names (its tables are most of it); requests imports it for the host names
  outside ASCII, which it encodes with it at the request (``idna.encode``), the only use.
* ``bz2`` and ``lzma`` (with their C extensions and libbz2/liblzma): ``shutil`` and ``zipfile`` import
  them to know whether they can (de)compress archives; the daemons' layers are gzip, zstd or plain
  tar (``tarfile`` mode ``r|`` imports neither).

Together about 4 to 5.5 MB of each daemon's memory (bench/bench_e2e.py, ``<daemon>_rss_mb`` and its
breakdown by mapping). :func:`install` (called by ``accelnode.cli`` before a node daemon imports
anything of its own) makes the import of each of them create the module without running it; the
first attribute the module does not have yet (``asyncio.run``, ``calendar.timegm``) runs it, once,
under a lock, so a thread that reaches it while another runs it waits and then sees the whole
module. Attributes the import system sets itself (``__name__``, ``__path__``) do not trigger it,
nor does a submodule of a deferred package (``from urllib3.http2 import probe`` imports the
submodule alone). Nothing is lost: whoever uses one of these modules gets it whole.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

DEFERRED = frozenset({"asyncio", "grpc.aio", "google.protobuf.internal.python_message", "html", "calendar",
                       "urllib3.http2", "prometheus_client", "idna", "bz2", "lzma"})

_LOCK = threading.RLock()  # one at a time, and re-entrant: a module's own body may import its submodules
_RUNNING: set[str] = set()  # modules whose body runs now (their own missing attributes are plain misses)


class _Deferred(types.ModuleType):
    """A module created but not run yet; the first attribute it lacks runs it."""

    def __getattr__(self, attr: str):  # only reached for attributes the module does not have
        name = self.__spec__.name
        if self.__spec__.submodule_search_locations is not None and type(self) is _Deferred \
                and name not in _RUNNING and importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")  # a submodule: imported, the package still not run
        with _LOCK:
            if type(self) is _Deferred and name not in _RUNNING:
                _RUNNING.add(name)
                try:
                    self.__spec__.loader.wrapped.exec_module(self)
                    self.__class__ = types.ModuleType
                finally:
                    _RUNNING.discard(name)
        try:
            return types.ModuleType.__getattribute__(self, attr)
        except AttributeError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None


class _Loader:  # not importlib.abc's: that imports importlib.resources, tempfile, shutil, bz2, lzma
    def __init__(self, wrapped):
        self.wrapped = wrapped

    def __getattr__(self, attr: str):  # get_source, get_filename, is_package ...: the real loader's
        return getattr(self.wrapped, attr)

    def create_module(self, spec):
        return self.wrapped.create_module(spec)

    def exec_module(self, module) -> None:
        module.__class__ = _Deferred


_PYTHON = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)


class _Finder:  # the import system needs find_spec only
    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, _PYTHON):
            return spec  # an extension module: imported as usual
        spec.loader = _Loader(spec.loader)
        return spec


def install(names=DEFERRED) -> bool:
    """Defer ``names`` from now on in this process; False when one of them is imported already
    (then nothing changes: a module half deferred would be two modules)."""
    if any(n in sys.modules for n in names):
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(names))
    return True
