"""What the node daemons leave out of memory: every module a process imports stays resident in
it, on every node (bench/bench_e2e.py measures them as pods by mapping)."""

from __future__ import annotations

import subprocess
import sys

import pytest

AGENT = "agent.core, agent.store, agent.service, agent.reporter, accelnode.oci.registry"


def _loaded(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("unused", ["charset_normalizer", "chardet", "tomllib", "isal"])
def test_the_agent_does_not_load_what_it_does_not_use(unused):
    assert unused not in _loaded(f"import {AGENT}")


def test_the_hidden_guessers_stay_importable_for_others():
    """requests is imported without them; any other library of the process still finds them."""
    loaded = _loaded("import accelnode.oci.registry, requests\n"
                     "assert requests.compat.chardet is None\n"
                     "import charset_normalizer")
    assert "charset_normalizer" in loaded


def test_a_registry_answer_without_a_charset_reads_as_utf8(registry):
    """What requests does with text when it has no guesser: UTF-8, no warning."""
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import accelnode.oci.registry, requests\n"
            f"r = requests.get('http://{registry.host}/v2/')\n"
            "assert r.apparent_encoding == 'utf-8' and isinstance(r.text, str)\n")
    _loaded(code)



# what the deferred modules of accelnode/deferred.py import when they run
BODIES = {"asyncio.base_events", "asyncio.tasks", "grpc.aio._channel", "grpc.aio._server", "google.protobuf.text_format",
          "html.entities", "importlib.metadata", "idna.core", "idna.idnadata", "_bz2", "_lzma"}

SERVE = """
import grpc
from concurrent import futures
echo = grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(
    lambda req, ctx: req, request_deserializer=bytes, response_serializer=bytes)})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[echo])
server.add_insecure_port("unix://SOCK")
server.start()
with grpc.insecure_channel("unix://SOCK") as ch:
    assert ch.unary_unary("/t.T/Echo")(b"hi", timeout=10) == b"hi"
server.stop(0)
"""


def _as(daemon: str) -> str:
    """Code that starts a process as the node daemon's command line does, up to its own modules."""
    return ("import sys\n"
            "from accelnode.cli import main\n"
            "try:\n"
            f"    main([{daemon!r}, '--help'])\n"
            "except SystemExit:\n"
            "    pass\n")


@pytest.mark.parametrize("daemon", ["device-plugin", "dra", "csi", "agent"])
def test_a_node_daemon_serving_grpc_does_not_run_what_it_does_not_use(daemon, tmp_path):
    """The command line defers those modules before the daemon's own modules load; a gRPC server
    and client work without them, and so do protobuf messages."""
    loaded = _loaded(_as(daemon) + SERVE.replace("SOCK", str(tmp_path / "s.sock")) +
                     "import urllib3\n"
                     "from accelnode.pb import deviceplugin_pb2 as pb\n"
                     "m = pb.Device(ID='chip-0', health='Healthy')\n"
                     "assert pb.Device.FromString(m.SerializeToString()) == m\n"
                     "from accelnode.deferred import DEFERRED\n"
                     "assert {type(sys.modules[n]).__name__ for n in DEFERRED if n in sys.modules} == {'_Deferred'}\n")
    assert not loaded & BODIES


# what each node daemon builds its metrics from (the modules its run function imports)
METRICS = {"device-plugin": "from device_plugin.metrics import Metrics\nreg = Metrics().registry\n",
           "dra": "from prometheus_client.registry import CollectorRegistry\nreg = CollectorRegistry()\n",
           "csi": "from prometheus_client.registry import CollectorRegistry\nfrom csi_driver.metrics import Metrics\n"
                  "reg = Metrics(CollectorRegistry()).registry\n",
           "agent": "from prometheus_client.registry import CollectorRegistry\nfrom agent import core\n"
                    "reg = CollectorRegistry(); core.Metrics(reg)\n"}


@pytest.mark.parametrize("daemon", sorted(METRICS))
def test_a_node_daemon_serves_its_metrics_without_prometheus_clients_package(daemon):
    """prometheus_client's package (its exposition module: HTTP servers, gzip, wsgiref, platform)
    stays deferred while the daemon builds its metrics and answers a scrape with our writer."""
    loaded = _loaded(_as(daemon) + METRICS[daemon] +
                     "from prometheus_client.metrics import Counter\n"
                     "Counter('accelnode_footprint_probe', 'probe', registry=reg).inc()\n"
                     "import http.client\n"
                     "from accelnode.httpserve import MetricsServer\n"
                     "srv = MetricsServer('127.0.0.1:0', reg, lambda: (True, '')).start()\n"
                     "c = http.client.HTTPConnection('127.0.0.1', srv.port, timeout=10)\n"
                     "c.request('GET', '/metrics'); r = c.getresponse(); body = r.read().decode()\n"
                     "srv.stop()\n"
                     "assert r.status == 200 and 'accelnode_footprint_probe_total 1.0' in body, body\n"
                     "assert r.getheader('Content-Type') == 'text/plain; version=0.0.4; charset=utf-8'\n"
                     "assert type(sys.modules['prometheus_client']).__name__ == '_Deferred'\n")
    assert not loaded & (BODIES | {"prometheus_client.exposition", "prometheus_client.platform_collector", "wsgiref"})


def test_other_commands_load_them_as_usual():
    loaded = _loaded("from accelnode.cli import main\n"
                     "try:\n"
                     "    main(['controller', '--help'])\n"
                     "except SystemExit:\n"
                     "    pass\n"
                     "import grpc\n")
    assert {"asyncio.base_events", "grpc.aio._channel"} <= loaded


def test_a_deferred_module_runs_whole_at_its_first_use(tmp_path):
    """The deferred modules used after all: asyncio.run, an aio channel, a message as text,
    calendar, html, prometheus_client's package after one of its submodules, a host name outside
    ASCII through requests (idna), bz2 and lzma; eight threads reaching asyncio at once all get the whole module
    (the others wait while one runs it)."""
    code = ("import sys, threading\n"
            "from accelnode import deferred\n"
            "assert deferred.install()\n"
            "import asyncio, grpc\n"
            "assert type(asyncio).__name__ == '_Deferred'\n"
            "go = threading.Barrier(8)\n"
            "got = []\n"
            "def use():\n"
            "    go.wait()\n"
            "    got.append(asyncio.run(asyncio.sleep(0, result=7)))\n"
            "threads = [threading.Thread(target=use) for _ in range(8)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "assert got == [7] * 8, got\n"
            "assert type(asyncio).__name__ == 'module'\n"
            "async def aio():\n"
            f"    async with grpc.aio.insecure_channel('unix://{tmp_path}/none.sock') as ch:\n"
            "        return ch.get_state()\n"
            "print('state', asyncio.run(aio()))\n"
            "from accelnode.pb import deviceplugin_pb2 as pb\n"
            "print('text', str(pb.Device(ID='chip-0')).strip())\n"
            "import calendar, html, urllib3\n"
            "assert 'importlib.metadata' not in sys.modules and urllib3.http2.probe.acquire_and_get\n"
            "print('http2', urllib3.http2.inject_into_urllib3.__name__, 'importlib.metadata' in sys.modules)\n"
            "print('timegm', calendar.timegm((1970, 1, 2, 0, 0, 0)), html.escape('<'))\n"
            "import prometheus_client.registry, prometheus_client\n"
            "print('prometheus', prometheus_client.generate_latest(prometheus_client.registry.CollectorRegistry()))\n"
            "import requests\n"
            "print('idna', requests.models.PreparedRequest._get_idna_encoded_host('b\u00fccher.example'))\n"
            "import bz2, lzma, shutil, zipfile\n"
            "print('packed', bz2.decompress(bz2.compress(b'x')), lzma.decompress(lzma.compress(b'y')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "state ChannelConnectivity.IDLE" in out.stdout
    assert "http2 inject_into_urllib3 True" in out.stdout
    assert 'text ID: "chip-0"' in out.stdout and "timegm 86400 &lt;" in out.stdout
    assert "prometheus b''" in out.stdout
    assert "idna xn--bcher-kva.example" in out.stdout
    assert "packed b'x' b'y'" in out.stdout


def test_nothing_is_deferred_once_it_is_imported():
    _loaded("import asyncio\n"
            "from accelnode import deferred\n"
            "assert not deferred.install()\n"
            "import grpc\n"
            "assert type(grpc.aio).__name__ == 'module'\n")
