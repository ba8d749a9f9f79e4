"""gRPC over unix sockets, the way kubelet's peers expect it.

* A stale socket file is removed before listening (never a non-socket file: that is an error).
* :func:`serve_unix` returns only after a client has connected to the new socket, so a
  caller may register with kubelet knowing the endpoint answers.
* :func:`serving_problem` is the liveness check of a daemon's gRPC server (accelnode.health).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from concurrent import futures
from pathlib import Path

import grpc

# sun_path holds 108 bytes including the terminating NUL
MAX_UNIX_PATH = 107


def remove_stale_socket(path: str | os.PathLike) -> None:
    p = Path(path)
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{p} exists and is not a socket; refusing to remove it")
    p.unlink()


def wait_listening(path: str | os.PathLike, timeout: float = 5.0) -> None:
    """Block until a unix-socket connect to ``path`` succeeds (proof that the server listens)."""
    import time

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(0.5)
            s.connect(str(path))
            return
        except OSError as e:
            last = e
            time.sleep(0.005)
        finally:
            s.close()
    raise TimeoutError(f"nothing listens on {path} after {timeout}s: {last}")


def serve_unix(path: str | os.PathLike, add_servicers, *, max_workers: int = 8, options=None) -> grpc.Server:
    """Start a gRPC server on unix socket ``path``.

    ``add_servicers(server)`` registers the servicers. The socket directory must exist.
    Returns a started server that has been proven to accept connections.
    """
    path = Path(path)
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise OSError(errno.ENAMETOOLONG, f"unix socket path is {len(os.fsencode(path))} bytes; "
                      f"the limit is {MAX_UNIX_PATH}", str(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "socket directory does not exist", str(path.parent))
    remove_stale_socket(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options or [])
    add_servicers(server)
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise OSError(f"cannot listen on unix socket {path}")
    server.start()
    wait_listening(path)
    return server


def serving_problem(path: str | os.PathLike, timeout: float = 2.0) -> str | None:
    """None when a gRPC server answers on unix socket ``path`` (the HTTP/2 handshake completes
    within ``timeout``), else what is wrong."""
    if not Path(path).is_socket():
        return f"gRPC server: no socket at {path}"
    with unix_channel(path) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return f"gRPC server on {path} did not answer within {timeout:.0f}s"
    return None


def unix_channel(path: str | os.PathLike, options=None) -> grpc.Channel:
    """A channel to a unix socket path (``unix://`` prefix optional)."""
    target = str(path)
    if not target.startswith("unix:"):
        target = f"unix://{target}"
    return grpc.insecure_channel(target, options=options or [])
