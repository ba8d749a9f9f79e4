"""The admission server as a process of its own, for tests and bench/bench_webhook.py that measure
what the process holds (threads, memory) while clients attack it.

    python -m tests.controller.admission_proc CERT KEY ROUTES [LIMITS_JSON]

ROUTES: ``allow`` (``/mutate`` admits everything) or ``tpuenv`` (controller/tpuenv/webhooks.py's
routes, as ``accelnode controller`` serves them). LIMITS_JSON: fields of
:class:`controller.webhooks.server.Limits`. Prints the port, serves until stdin closes; logs JSON
at info to /dev/null as the daemon logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(cert: str, key: str, routes: str, limits: str = "{}") -> None:
    from accelnode import log as alog
    from controller.webhooks.server import AdmissionServer, allow

    if routes == "tpuenv":
        from controller.tpuenv.webhooks import routes as tpuenv_routes
        table = tpuenv_routes()
    else:
        table = {"/mutate": lambda request: allow()}
    alog.setup("info", "json", stream=open(os.devnull, "w"))
    given = json.loads(limits)
    if given:
        from controller.webhooks.server import Limits
    server = AdmissionServer("127.0.0.1:0", cert, key, table, **({"limits": Limits(**given)} if given else {})).start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


class AdmissionProc:
    """The server process: ``port``, ``pid``; ``stop()`` closes its stdin and waits."""

    def __init__(self, cert: str, key: str, routes: str = "allow", **limits):
        # the caller's PYTHONPATH first: a benchmark may point ``controller`` at another tree
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.controller.admission_proc", cert, key, routes,
                                      json.dumps(limits)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd="/", env=env)  # not ROOT: ``-m`` puts the working directory first
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the admission server process did not start: {line!r}")
        self.port, self.pid = int(line), self.proc.pid

    def status(self, field: str) -> int:
        """A number from /proc/PID/status: ``Threads``, ``VmRSS`` or ``VmHWM`` (KiB)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main(*sys.argv[1:])
