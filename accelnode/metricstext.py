"""The Prometheus text exposition format (version 0.0.4) of a metrics registry: what ``/metrics``
answers (accelnode/httpserve.py).

Ours rather than ``prometheus_client.generate_latest`` because that one lives in
``prometheus_client.exposition``, which imports an HTTP server, an HTTP client, gzip, wsgiref and
``platform`` with it, and the package ``prometheus_client`` imports that module and its default
collectors whenever it runs: the node daemons keep the package deferred (accelnode/deferred.py)
and take their metric classes from ``prometheus_client.metrics`` and ``prometheus_client.registry``
(about 0.3 to 1.5 MB a daemon). The output is the same, byte for byte, as prometheus_client's
(tests/test_metricstext.py compares them):

* per family ``# HELP name text`` (``\\`` and newline escaped) and ``# TYPE name type``, then its
  samples ``name{label="value",...} value [timestamp_ms]``, labels sorted by name, values with
  ``\\``, ``"`` and newline escaped;
* a counter family is named with ``_total``, an info family with ``_info`` and typed gauge, a
  stateset is a gauge, a gauge histogram a histogram, an unknown type ``untyped``;
* a family's ``_created``, ``_gsum`` and ``_gcount`` samples come after it, each as its own gauge;
* numbers as Go prints them: ``+Inf``, ``-Inf``, ``NaN``, and from 1e6 on (positive) in exponent
  form, ``1.5e+06``.

Metric and label names must be Prometheus' classic ones (``[a-zA-Z_:][a-zA-Z0-9_:]*``, labels
without ``:``): a name outside them is a programming error and raises ValueError.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, Protocol

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# the family name suffix and the type this format gives each OpenMetrics type
_TYPES = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
          "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}
_APART = ("_created", "_gcount", "_gsum")  # samples written after their family, each as a gauge (sorted)


class Collector(Protocol):
    def collect(self) -> Iterable: ...


def number(value) -> str:
    """``value`` as Prometheus (Go) prints a sample value."""
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    text = repr(v)
    whole, dot, frac = text.partition(".")
    if v > 0 and dot and len(whole) > 6:  # 1e6 <= v < 1e16: Go's %g turns to the exponent, Python's repr not yet
        mantissa = f"{whole[0]}.{whole[1:]}{frac}".rstrip("0").rstrip(".")
        return f"{mantissa}e+{len(whole) - 1:02d}"
    return text


def _name(name: str, pattern: re.Pattern, what: str) -> str:
    if not pattern.fullmatch(name):
        raise ValueError(f"{what} {name!r} is not a classic Prometheus name")
    return name


def _value(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _help(name: str, doc: str, kind: str) -> str:
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def _sample(sample) -> str:
    labels = ",".join(f'{_name(k, _LABEL_NAME, "label name")}="{_value(v)}"' for k, v in sorted(sample.labels.items()))
    stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
    return f"{_name(sample.name, _METRIC_NAME, 'metric name')}{'{' + labels + '}' if labels else ''} " \
           f"{number(sample.value)}{stamp}\n"


def render(registry: Collector) -> bytes:
    """Every family ``registry`` collects now, in the text format, UTF-8."""
    out: list[str] = []
    for family in registry.collect():
        suffix, kind = _TYPES.get(family.type, ("", family.type))
        out.append(_help(_name(family.name + suffix, _METRIC_NAME, "metric name"), family.documentation, kind))
        apart: dict[str, list[str]] = {}
        for sample in family.samples:
            tail = next((t for t in _APART if sample.name == family.name + t), None)
            (apart.setdefault(tail, []) if tail else out).append(_sample(sample))
        for tail in sorted(apart):
            out.append(_help(family.name + tail, family.documentation, "gauge"))
            out.extend(apart[tail])
    return "".join(out).encode("utf-8")
