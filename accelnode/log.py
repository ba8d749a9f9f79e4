"""One structured log format for every daemon.

Each record is one line: JSON (``--log-format json``, the default for daemons) or
``key=value`` text. Extra fields are passed as keyword arguments through :func:`kv`::

    log.info("registered with kubelet", extra=kv(resource="google.com/tpu", endpoint=sock))

Secrets never go through here: callers pass names and digests, never tokens or passwords.
A digest of a secret is :func:`secret_digest`: keyed with a random key of this process (HMAC),
so that a log reader cannot test guesses of the secret against it, as a plain hash would let
them (a password is often guessable). A last-line defence masks values of fields whose names
look secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import sys
import threading
import time

_STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_SECRET_WORDS = ("token", "password", "secret", "authorization", "auth")


_DIGEST_KEY = secrets.token_bytes(32)  # this process's: digests of one secret differ between processes


def secret_digest(*parts: bytes) -> str:
    """16 hex digits naming a secret (``parts`` joined unambiguously) within this process: equal
    for equal secrets, useless for testing a guess outside it."""
    h = hmac.new(_DIGEST_KEY, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big") + p)
    return h.hexdigest()[:16]


def kv(**fields) -> dict:
    """Wrap structured fields for ``logging``'s ``extra=`` argument."""
    return {"fields": fields}


def _fields(record: logging.LogRecord) -> dict:
    out = dict(getattr(record, "fields", {}) or {})
    for k, v in vars(record).items():
        if k not in _STD and k != "fields":
            out[k] = v
    for k in list(out):
        if any(w in k.lower() for w in _SECRET_WORDS):
            out[k] = "<redacted>"
    return out


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        parts = [f"{ts}.{int(record.msecs):03d}", record.levelname.lower(), record.name, record.getMessage()]
        for k, v in _fields(record).items():
            s = str(v)
            parts.append(f"{k}={json.dumps(s) if (' ' in s or not s) else s}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: str = "info", fmt: str = "json", stream=None) -> None:
    """Configure the root logger once for a process, and log a thread that dies of an uncaught
    exception as one structured record with its traceback (at critical: whatever the level)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    threading.excepthook = _thread_died
    # grpc and urllib3 are chatty at debug; keep them at warning unless asked.
    for name in ("urllib3", "grpc", "asyncio"):
        logging.getLogger(name).setLevel(logging.WARNING if level != "debug" else logging.DEBUG)


def _thread_died(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else None
    logging.getLogger("accelnode").critical("thread died", exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
                                            extra=kv(thread=name, error=f"{args.exc_type.__name__}: {args.exc_value}"))
