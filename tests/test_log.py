"""A daemon that dies says why once, as a structured record with its traceback, whatever the
log level: the main thread through the CLI's last resort, any other thread through the
threading hook that ``accelnode.log.setup`` installs."""

from __future__ import annotations

import io
import json
import logging
import threading

from accelnode import cli

from accelnode import exitcodes

from accelnode import log as alog


def _records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_a_command_that_dies_logs_its_traceback_once_at_any_level(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("disk on fire")

    def parser(command=None):
        p = cli.argparse.ArgumentParser(prog="accelnode")
        sub = p.add_subparsers(dest="command")
        c = sub.add_parser("boom")
        cli.add_common(c)
        c.set_defaults(func=boom)
        return p

    stream = io.StringIO()
    monkeypatch.setattr(cli, "build_parser", parser)
    real_setup = alog.setup
    monkeypatch.setattr(alog, "setup", lambda level, fmt: real_setup(level, fmt, stream=stream))
    root = logging.getLogger()
    saved = root.handlers[:], root.level, threading.excepthook
    try:
        assert cli.main(["boom", "--log-level", "error"]) == exitcodes.FAILURE
    finally:
        root.handlers[:], level, threading.excepthook = saved
        root.setLevel(level)
    died = [r for r in _records(stream) if r["msg"] == "command died"]
    assert len(died) == 1
    assert died[0]["level"] == "critical" and died[0]["command"] == "boom"
    assert died[0]["error"] == "RuntimeError: disk on fire"
    assert "Traceback" in died[0]["exc"] and "in boom" in died[0]["exc"]
    assert capsys.readouterr().err.strip() == "accelnode boom: RuntimeError: disk on fire"


def test_a_thread_that_dies_logs_its_traceback_as_one_record():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level, threading.excepthook
    try:
        alog.setup("error", "json", stream=stream)

        def watch_loop():
            raise ValueError("bad event")

        t = threading.Thread(target=watch_loop, name="reflector-pods")
        t.start()
        t.join()
    finally:
        root.handlers[:], level, threading.excepthook = saved
        root.setLevel(level)
    (rec,) = _records(stream)
    assert (rec["msg"], rec["level"], rec["thread"]) == ("thread died", "critical", "reflector-pods")
    assert rec["error"] == "ValueError: bad event"
    assert "Traceback" in rec["exc"] and "in watch_loop" in rec["exc"]


def test_a_logged_digest_of_pull_secrets_cannot_test_a_guessed_password():
    """The agent logs ``credentials=<PullSecrets.key>`` with every pull. A log reader who guesses
    a tenant's registry password must not be able to check the guess against it: the digest is
    keyed per process (on main it was a plain SHA-256 of the Docker config, password included)."""
    import base64
    import hashlib
    import subprocess
    import sys

    from accelnode.kube.pullsecrets import PullSecrets

    config = json.dumps({"auths": {"reg.example.com": {"auth": base64.b64encode(b"alice:hunter2").decode()}}})
    key = PullSecrets("team-a", (("team-a/regcred", config),)).key
    guess = hashlib.sha256(b"team-a/regcred\0" + config.encode() + b"\0").hexdigest()[:16]
    assert key.startswith("tenant:team-a:") and guess not in key and "hunter2" not in key
    assert key == PullSecrets("team-a", (("team-a/regcred", config),)).key  # stable within the process
    other = subprocess.run([sys.executable, "-c", "import sys; from accelnode.kube.pullsecrets import PullSecrets; "
                            "print(PullSecrets('team-a', (('team-a/regcred', sys.argv[1]),)).key)", config],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert other.startswith("tenant:team-a:") and other != key
