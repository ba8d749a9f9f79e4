"""accelnode/metricstext.py: our text exposition writer gives what prometheus_client's
generate_latest gives, byte for byte, and a Prometheus text parser reads it back."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                            UnknownMetricFamily)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from accelnode import metricstext

HOSTILE = 'a\\b"c\nd} ,e="f'  # backslash, quote, newline and the characters that end a label set


class _Family:
    """A custom collector as ours write them (csi_driver/metrics.py): families built at scrape."""

    def collect(self):
        g = GaugeMetricFamily("accelnode_test_views", "Views by state,\nwith a \\ in help", labels=["state", "path"])
        g.add_metric(["ready", HOSTILE], 3)
        g.add_metric(["gone", "/var/lib/kubelet/pods/\u00e9"], 0, timestamp=1700000000.123)
        yield g
        c = CounterMetricFamily("accelnode_test_bytes", "Bytes", labels=["kind"], created=1700000000.5)
        c.add_metric(["x"], 1e20, created=1700000001.0)
        yield c
        yield GaugeHistogramMetricFamily("accelnode_test_queue", "Queue", buckets=[("1", 2), ("+Inf", 3)], gsum_value=7)
        yield UnknownMetricFamily("accelnode_test_other", "Untyped", value=1)


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    c = Counter("accelnode_test_ops", "Operations, by method and code", ["method", "code"], registry=reg)
    c.labels(method="Publish", code="OK").inc()
    c.labels(method=HOSTILE, code="").inc(2.5)
    Counter("accelnode_test_never", "A counter without labels, never touched", registry=reg)
    g = Gauge("accelnode_test_level", "Levels", ["which"], registry=reg)
    for i, v in enumerate([0, -0.0, 1, -1, 0.1, 1e-7, 123456.0, 999999.0, 1e6, 1234567.0, 2.5e7, 12345678.9, 1e15,
                           1e16, 1.5e16, 1e300, -2e7, -1e17, math.inf, -math.inf, math.nan, 2**53 + 1.0]):
        g.labels(which=str(i)).set(v)
    Gauge("accelnode_test_fn", "Set by a function", registry=reg).set_function(lambda: 42)
    h = Histogram("accelnode_test_seconds", "Durations", ["method"], registry=reg,
                  buckets=(0.001, 0.0025, 0.5, 1, 5, 30, 120, 1e6, 2.5e7))
    h.labels(method="NodePublishVolume").observe(0.002)
    h.labels(method="NodePublishVolume").observe(40)
    h.labels(method=HOSTILE).observe(3e7)
    s = Summary("accelnode_test_sizes", "Sizes", registry=reg)
    s.observe(512)
    Info("accelnode_test_build", "Build", registry=reg).info({"version": "1.2.3", "commit": HOSTILE})
    Enum("accelnode_test_state", "State", states=["up", "down"], registry=reg).state("down")
    reg.register(_Family())
    return reg


@pytest.mark.parametrize("created", [True, False], ids=["created-series", "no-created-series"])
def test_our_text_is_prometheus_clients_byte_for_byte(created, monkeypatch):
    """Every metric type, hostile label values and help text, every class of number; with and
    without the _created series (PROMETHEUS_DISABLE_CREATED_SERIES)."""
    import prometheus_client.metrics as pm
    monkeypatch.setattr(pm, "_use_created", created)
    reg = _registry()
    ours = metricstext.render(reg)
    assert ours == generate_latest(reg)
    assert (b"accelnode_test_ops_created" in ours) == created


def test_a_prometheus_parser_reads_it_back():
    families = {f.name: f for f in text_string_to_metric_families(metricstext.render(_registry()).decode())}
    ops = {tuple(sorted(s.labels.items())): s.value for s in families["accelnode_test_ops"].samples
           if s.name == "accelnode_test_ops_total"}
    assert ops[(("code", ""), ("method", HOSTILE))] == 2.5
    levels = {s.labels["which"]: s.value for s in families["accelnode_test_level"].samples}
    assert levels["9"] == 1234567.0 and levels["13"] == 1e16 and levels["16"] == -2e7
    assert levels["18"] == math.inf and levels["19"] == -math.inf and math.isnan(levels["20"])
    assert families["accelnode_test_views"].documentation == "Views by state,\nwith a \\ in help"
    views = {s.labels["path"]: s for s in families["accelnode_test_views"].samples}
    assert views[HOSTILE].value == 3 and views["/var/lib/kubelet/pods/\u00e9"].timestamp == 1700000000.123
    assert families["accelnode_test_seconds"].type == "histogram"
    buckets = {(s.labels["method"], s.labels.get("le")): s.value for s in families["accelnode_test_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets[(HOSTILE, "2.5e+07")] == 0 and buckets[(HOSTILE, "+Inf")] == 1


@pytest.mark.parametrize("value", [0.0, 5.0, 0.25, 1e6, 1234567.0, 9999999.5, 1e15, 1e16, 1.5e16, 1e-9, -3e9,
                                   float("inf"), float("-inf"), float("nan"), 7])
def test_numbers_as_prometheus_client_prints_them(value):
    from prometheus_client.utils import floatToGoString
    assert metricstext.number(value) == floatToGoString(value)


@pytest.mark.parametrize("name, labels", [("bad name", {}), ("ok", {"bad-label": "x"}), ("ok", {"a:b": "x"})])
def test_a_name_outside_the_classic_set_is_refused(name, labels):
    class Odd:
        def collect(self):
            g = GaugeMetricFamily("accelnode_test", "t")
            g.samples.append(Sample(name, labels, 1.0))
            yield g

    with pytest.raises(ValueError, match="classic Prometheus name"):
        metricstext.render(Odd())
