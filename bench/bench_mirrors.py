"""Pull-through cache benchmark: ``AGENTS`` (20) agents on this machine, each with a store of its
own, pull one 512 MiB / 8-layer Triton cache (bench_cache's ``make_cache``, pushed once with our
build code to an origin registry, Debian's ``docker-registry``) directly or through a pull-through
cache in front of that origin.

An agent here is one ``accelnode cache pull IMAGE --store DIR`` process (the ``CacheStore.ensure``
path the agent daemon runs for a pod), all of a roll started at once; its pull time is its wall
time from start to exit, interpreter start-up included. The image keeps the origin's name
(``127.0.0.1:ORIGINPORT/bench/cache@sha256:...``); a roll goes through a mirror by configuration
(``--registry-mirror ORIGIN=MIRROR``, a hosts.toml whose only host is ``server = MIRROR``: every
request to the mirror, no fallback, so a mirror's failure shows as a failed pull rather than as
bytes quietly fetched from the origin; ``--hosts-dir`` names an empty directory in every roll, so
this machine's /etc/containerd/certs.d plays no part). On this
2-core machine 20 concurrent pulls share 2 cores and one disk; the times are as measured.

Where bytes came from is read from the origin's own access log (combined format: bytes sent
per answered GET of ``/v2/.../blobs/sha256:...``), as the difference across one roll.

The direct, mirror and nginx rolls are each run ``ROUNDS`` (2) times, interleaved in ABBA order
(direct, mirror, nginx, nginx, mirror, direct) so that drifts of this machine's disk and caches
fall on every kind alike (identical rolls differ by up to a quarter here); every mirror or nginx
roll goes through a fresh (cold) cache of its own, started for it and stopped after it. Times are
medians and maxima over every agent of every round of a kind, in seconds; an origin ratio is the
largest of its rounds.

Metrics:
- ``direct_pull_median_s``, ``direct_pull_max_s``: every agent pulls from the origin;
- ``mirror_pull_median_s``, ``mirror_pull_max_s``: fresh stores, a fresh distribution pull-through
  cache (``docker-registry`` in proxy mode, distribution 2.8.2), every agent at once (cold);
  ``mirror_vs_direct``: ``mirror_pull_median_s / direct_pull_median_s`` (same run);
- ``origin_bytes_ratio``: the origin's blob bytes sent during a cold roll through that cache
  divided by the image's compressed blob bytes (its layers plus its config, ``image_blob_mib``):
  1.0 is every byte fetched from the origin once. Target 1.05. Distribution 2.8's proxy cannot
  meet it whatever the client does: on a blob's first request it fetches the blob from the
  origin twice (one copy stored, one streamed to the client), and every request for the blob
  while that is in flight streams from the origin again, so 20 agents at once cost about 20x;
- ``nginx_pull_median_s``, ``nginx_pull_max_s``, ``nginx_vs_direct``, ``origin_bytes_ratio_nginx``
  (target 1.05): the same cold rolls through nginx (Debian ``nginx-light``) as a caching reverse
  proxy that collapses concurrent misses (``proxy_cache_lock``: one origin fetch per blob, the
  other requests wait for it and are answered from the cache; cache key: the URI path without
  the query; blobs cached, everything else passed through). Skipped, with a line saying so,
  when ``nginx`` is not installed;
- ``staged_first_pull_s``, ``staged_rest_pull_median_s``, ``staged_rest_pull_max_s``,
  ``origin_bytes_ratio_staged``: once, another fresh distribution proxy, one agent first
  (warming it), then the other 19 at once; the ratio counts both steps;
- fallback (needs hosts.toml support: ``accelnode cache pull --hosts-dir``; skipped with a line
  saying so without it): one agent at a time, a fresh store each pull, the warm distribution
  proxy of the staged roll as the working mirror; a hosts.toml with that mirror first then
  ``server`` (the origin), against one with a dead ``[host]`` first, then the mirror, then
  ``server``, every host with ``dial_timeout = "500ms"``. Two kinds of dead: a closed port
  (connection refused) and a blackhole (a listening socket with backlog 0 whose queue this
  benchmark fills, so further SYNs are dropped and a connect times out).
  ``fallback_up_pull_s``, ``fallback_refused_pull_s``, ``fallback_timeout_pull_s``: medians of
  ``FALLBACK_ROUNDS`` pulls, interleaved; ``fallback_extra_refused_s``,
  ``fallback_extra_timeout_s``: down minus up; ``fallback_extra_beyond_dial_refused_s`` and
  ``fallback_extra_beyond_dial_timeout_s``: that minus the 0.5 s dial timeout, target 1.0.
  Each pull is a new process, so each pays for the dead mirror once (a long-running agent
  remembers it down for 30 s and pays once per 30 s): the per-pull worst case.
  ``fallback_origin_bytes_ratio``: the origin's blob bytes sent during all those pulls over the
  image's (0: every pull got its blobs from the mirror, none fell through to ``server``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures.registry import RunningRegistry, _free_port  # noqa: E402  (needs ROOT on sys.path)

G = "mirrors"
AGENTS = int(os.environ.get("BENCH_MIRRORS_AGENTS", "20"))
ROUNDS = int(os.environ.get("BENCH_MIRRORS_ROUNDS", "2"))
FALLBACK_ROUNDS = int(os.environ.get("BENCH_MIRRORS_FALLBACK_ROUNDS", "5"))
DIAL_TIMEOUT_S = 0.5
ORIGIN_RATIO_GOAL = 1.05
FALLBACK_GOAL_S = 1.0
MANIFEST_TYPES = "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json"


def emit(metric: str, value: float, fmt: str = ".2f", target: str | None = None) -> None:
    line = f"BENCH {G} {metric}={value:{fmt}}"
    if target:
        line += f" target_{metric}{target}"
    print(line, flush=True)


def say(text: str) -> None:
    print(f"bench {G}: {text}", flush=True)


# --- agents -----------------------------------------------------------------------------------

def pull_cmd(image: str, store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "accelnode", "cache", "pull", image, "--store", str(store),
            "--log-level", "warning", *extra]


def pull_all(image: str, stores: list[Path], *extra: str) -> list[float]:
    """Every store's pull of ``image`` started at once; each one's wall seconds, in store order.
    A failed pull raises, with the end of its output."""
    results: list[tuple[float, int, bytes] | None] = [None] * len(stores)

    def one(i: int) -> None:
        start = time.monotonic()
        proc = subprocess.run(pull_cmd(image, stores[i], *extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
        results[i] = (time.monotonic() - start, proc.returncode, proc.stderr)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [(i, rc, err) for i, (_, rc, err) in enumerate(results) if rc != 0]
    if failed:
        i, rc, err = failed[0]
        raise RuntimeError(f"{len(failed)} of {len(stores)} pulls failed; agent {i} exited {rc}: "
                           f"{err.decode(errors='replace')[-2000:]}")
    return [secs for secs, _, _ in results]


def fresh_stores(work: Path, roll: str, n: int) -> list[Path]:
    return [work / "stores" / roll / f"agent{i:02d}" for i in range(n)]


def drop_stores(work: Path) -> None:
    shutil.rmtree(work / "stores", ignore_errors=True)


# --- where bytes came from ----------------------------------------------------------------------

def settled_bytes(origin, quiet_s: float = 1.0, timeout: float = 120.0) -> int:
    """The origin's blob bytes sent so far, once its access log has stopped growing for
    ``quiet_s`` (a pull-through cache may still be storing a blob after its client got it)."""
    last, since, end = origin.blob_bytes_sent(), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        time.sleep(0.2)
        now = origin.blob_bytes_sent()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def image_blob_bytes(origin, image: str) -> int:
    """The compressed size of the image's blobs: its layers and its config, from its manifest."""
    name, digest = image.split("/", 1)[1].split("@")
    req = urllib.request.Request(f"http://{origin.host}/v2/{name}/manifests/{digest}",
                                 headers={"Accept": MANIFEST_TYPES})
    with urllib.request.urlopen(req, timeout=30) as r:
        manifest = json.load(r)
    return manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])


# --- nginx as a pull-through cache that collapses concurrent misses -----------------------------

NGINX_CONF = """\
user root;
worker_processes 2;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy_temp;
    fastcgi_temp_path {d}/fastcgi_temp;
    uwsgi_temp_path {d}/uwsgi_temp;
    scgi_temp_path {d}/scgi_temp;
    proxy_cache_path {d}/cache levels=1:2 keys_zone=blobs:10m max_size=8g inactive=1h use_temp_path=off;
    proxy_http_version 1.1;
    proxy_read_timeout 600s;
    server {{
        listen {listen};
        # blobs are content-addressed: cached on the path alone (containerd-style clients append
        # ?ns=<registry>), one origin fetch per blob however many ask at once
        location ~ "^/v2/.+/blobs/sha256:[0-9a-f]{{64}}$" {{
            proxy_pass http://{upstream};
            proxy_cache blobs;
            proxy_cache_key $uri;
            proxy_cache_valid 200 206 30d;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 600s;
            proxy_cache_lock_age 600s;
        }}
        # /v2/, manifests (tags move): passed through
        location / {{
            proxy_pass http://{upstream};
            proxy_buffering off;
        }}
    }}
}}
"""


class Nginx:
    """nginx in the foreground on 127.0.0.1, caching ``upstream``'s blobs under ``workdir``."""

    def __init__(self, workdir: Path, upstream: str):
        workdir.mkdir(parents=True)
        self.workdir = workdir
        self.host = f"127.0.0.1:{_free_port()}"
        conf = workdir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(d=workdir, listen=self.host, upstream=upstream))
        self.log = open(workdir / "stderr.log", "ab")
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log"),
             "-g", f"daemon off; pid {workdir / 'nginx.pid'}; error_log {workdir / 'error.log'} warn;"],
            stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"nginx did not start: {(workdir / 'error.log').read_text(errors='replace')}")
                time.sleep(0.05)

    stop = RunningRegistry.stop  # SIGTERM (nginx's fast shutdown), then SIGKILL; closes self.log


# --- dead mirrors -----------------------------------------------------------------------------

def closed_port() -> int:
    """A loopback port nothing listens on: a connect is refused at once."""
    return _free_port()


def blackhole() -> tuple[int, list[socket.socket]]:
    """A loopback port whose connects time out: a listener with backlog 0 never accepting, its
    queue filled here so that the kernel drops further SYNs. The sockets must stay open (and be
    closed by the caller). Raises when a connect there does not time out on this kernel."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    held = [listener]
    for _ in range(16):
        s = socket.socket()
        s.settimeout(0.3)
        held.append(s)
        try:
            s.connect(("127.0.0.1", port))
        except TimeoutError:
            return port, held  # the queue is full: this connect, and the next ones, time out
    for s in held:
        s.close()
    raise RuntimeError("a listener with backlog 0 kept accepting connections: no blackhole on this kernel")


# --- hosts.toml ---------------------------------------------------------------------------------

def hosts_supported() -> bool:
    out = subprocess.run([sys.executable, "-m", "accelnode", "cache", "pull", "--help"], cwd=ROOT,
                         capture_output=True, text=True)
    return "--hosts-dir" in out.stdout


def write_hosts(directory: Path, registry: str, mirrors: list[str]) -> Path:
    """``directory/<registry>/hosts.toml``: ``mirrors`` (HOST:PORT, plain HTTP) tried in order,
    then the registry itself as ``server``; each with a 500 ms dial timeout."""
    shutil.rmtree(directory, ignore_errors=True)
    (directory / registry).mkdir(parents=True)
    text = f'server = "http://{registry}"\n'
    for m in mirrors:
        text += (f'\n[host."http://{m}"]\n  capabilities = ["pull", "resolve"]\n'
                 f'  dial_timeout = "{int(DIAL_TIMEOUT_S * 1000)}ms"\n')
    (directory / registry / "hosts.toml").write_text(text)
    return directory


# --- the rolls ----------------------------------------------------------------------------------

def roll(origin, image: str, work: Path, name: str, mirror: str | None, blob_bytes: int,
         agents: int = AGENTS) -> tuple[list[float], float]:
    """``agents`` fresh stores pull ``image`` at once (through ``mirror`` when given): their
    times, and the origin's blob bytes sent meanwhile as a ratio to ``blob_bytes``."""
    extra = ["--plain-http", "--hosts-dir", str(work / "no-hosts")]  # not this machine's certs.d
    extra += [f"--registry-mirror={origin.host}={mirror}"] if mirror else []
    before = settled_bytes(origin)
    times = pull_all(image, fresh_stores(work, name, agents), *extra)
    ratio = (settled_bytes(origin) - before) / blob_bytes
    drop_stores(work)
    say(f"{name}: {agents} pulls, median {statistics.median(times):.2f}s max {max(times):.2f}s, "
        f"origin sent {ratio:.2f}x the image")
    return times, ratio


def fallback(origin, image: str, work: Path, mirror: str, blob_bytes: int) -> None:
    before = settled_bytes(origin)
    dead_refused = closed_port()
    dead_timeout, held = blackhole()
    try:
        configs = {"up": [mirror], "refused": [f"127.0.0.1:{dead_refused}", mirror],
                   "timeout": [f"127.0.0.1:{dead_timeout}", mirror]}
        secs: dict[str, list[float]] = {k: [] for k in configs}
        for r in range(FALLBACK_ROUNDS):
            k = r % len(configs)
            order = list(configs)[k:] + list(configs)[:k]  # rotate who goes first
            for kind in order:
                hosts = write_hosts(work / f"hosts-{kind}", origin.host, configs[kind])
                store = work / "stores" / f"fallback-{kind}-{r}"
                secs[kind].append(pull_all(image, [store], "--hosts-dir", str(hosts))[0])
                drop_stores(work)
    finally:
        for s in held:
            s.close()
    from_origin = (settled_bytes(origin) - before) / blob_bytes
    med = {k: statistics.median(v) for k, v in secs.items()}
    say("fallback pulls: " + ", ".join(f"{k} {' '.join(f'{s:.2f}' for s in v)}" for k, v in secs.items()))
    emit("fallback_up_pull_s", med["up"])
    for kind in ("refused", "timeout"):
        extra = med[kind] - med["up"]
        emit(f"fallback_{kind}_pull_s", med[kind])
        emit(f"fallback_extra_{kind}_s", extra)
        emit(f"fallback_extra_beyond_dial_{kind}_s", extra - DIAL_TIMEOUT_S, target=f"<={FALLBACK_GOAL_S}")
    emit("fallback_dial_timeout_s", DIAL_TIMEOUT_S)
    emit("fallback_origin_bytes_ratio", from_origin)


def main() -> None:
    from bench.bench_cache import LAYERS, make_cache

    if not shutil.which("docker-registry"):
        raise RuntimeError("docker-registry missing (Debian package docker-registry: make system-deps)")
    have_nginx = shutil.which("nginx") is not None
    if not have_nginx:
        say("nginx not installed (Debian package nginx-light, tools/apt/cache.txt): "
            "the nginx pull-through cache rolls are skipped")
    work = Path(tempfile.mkdtemp(prefix="bench-mirrors.", dir=os.environ.get("ACCELNODE_BENCH_DIR")))
    servers: list = []

    def registry(name: str, **kw) -> RunningRegistry:
        (work / name).mkdir()
        servers.append(RunningRegistry(work / name, **kw))
        return servers[-1]

    def nginx(name: str) -> Nginx:
        servers.append(Nginx(work / name, origin.host))
        return servers[-1]

    try:
        origin = registry("origin")
        make_cache(work / "src")
        image = origin.push(work / "src", "bench/cache", "v1", layers=LAYERS)
        shutil.rmtree(work / "src")
        blob_bytes = image_blob_bytes(origin, image)
        emit("agents", AGENTS, "d")
        emit("rounds", ROUNDS, "d")
        emit("image_blob_mib", blob_bytes / 2**20, ".1f")

        # each roll through a fresh (cold) pull-through cache, stopped after it
        fresh = {"direct": None, "mirror": lambda r: registry(f"proxy{r}", proxy=f"http://{origin.host}")}
        if have_nginx:
            fresh["nginx"] = lambda r: nginx(f"nginx{r}")
        times: dict[str, list[float]] = {k: [] for k in fresh}
        ratios: dict[str, list[float]] = {k: [] for k in fresh}
        for r in range(ROUNDS):
            for kind in (list(fresh) if r % 2 == 0 else list(fresh)[::-1]):  # ABBA: drifts cancel
                server = fresh[kind](r) if fresh[kind] else None
                t, ratio = roll(origin, image, work, f"{kind}{r}", server and server.host, blob_bytes)
                if server:
                    server.stop()
                times[kind] += t
                ratios[kind].append(ratio)
        direct = statistics.median(times["direct"])
        emit("direct_pull_median_s", direct)
        emit("direct_pull_max_s", max(times["direct"]))
        emit("mirror_pull_median_s", statistics.median(times["mirror"]))
        emit("mirror_pull_max_s", max(times["mirror"]))
        emit("mirror_vs_direct", statistics.median(times["mirror"]) / direct)
        emit("origin_bytes_ratio", max(ratios["mirror"]), target=f"<={ORIGIN_RATIO_GOAL}")
        if have_nginx:
            emit("nginx_pull_median_s", statistics.median(times["nginx"]))
            emit("nginx_pull_max_s", max(times["nginx"]))
            emit("nginx_vs_direct", statistics.median(times["nginx"]) / direct)
            emit("origin_bytes_ratio_nginx", max(ratios["nginx"]), target=f"<={ORIGIN_RATIO_GOAL}")

        warm = registry("proxy-staged", proxy=f"http://{origin.host}")
        first, ratio_first = roll(origin, image, work, "staged-first", warm.host, blob_bytes, agents=1)
        rest, ratio_rest = roll(origin, image, work, "staged-rest", warm.host, blob_bytes, agents=AGENTS - 1)
        emit("staged_first_pull_s", first[0])
        emit("staged_rest_pull_median_s", statistics.median(rest))
        emit("staged_rest_pull_max_s", max(rest))
        emit("origin_bytes_ratio_staged", ratio_first + ratio_rest)

        if hosts_supported():
            fallback(origin, image, work, warm.host, blob_bytes)
        else:
            say("`accelnode cache pull` has no --hosts-dir (hosts.toml support) yet: the fallback "
                "measurement is skipped")
    finally:
        for s in reversed(servers):
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
