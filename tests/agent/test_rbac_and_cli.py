"""The agent's identity (daemonsets/rbac-agent.yaml) does what the reporter needs and no more,
and ``accelnode agent --node-name`` runs the reporter in the real agent process."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from accelnode.kube.client import Client, Config, KubeError, custom_path
from tests.agent.conftest import eventually
from tests.agent.test_kube import EXEC_USER
from tests.agent.test_status import digest_of, entry_in
from tests.conftest import accelnode_cmd


def forbidden(client: Client, method: str, path: str, body=None) -> str:
    with pytest.raises(KubeError) as err:
        client.request(method, path, body=body)
    assert err.value.code == 403, err.value
    return err.value.message


def test_agent_identity_cannot_write_outside_its_role(control_plane, cluster, node_factory, images, kube_namespace):
    ns = kube_namespace
    node = node_factory().start()
    cluster.cache("kernels", images.tpu, namespace=ns, pin=False)
    node.ensure(images.tpu, (ns, "kernels"))
    assert entry_in("Extracted", cluster, node.name, ns, "kernels", digest_of(images.tpu))  # its own writes work

    agent = Client(Config.from_kubeconfig(control_plane.kubeconfig("agent")))
    cache_status = custom_path("gkm.io", "v1alpha1", "gkmcaches", ns, "kernels", "status")
    msg = forbidden(agent, "PATCH", cache_status, body={"status": {"resolvedDigest": "sha256:" + "0" * 64}})
    assert 'cannot patch resource "gkmcaches/status"' in msg, msg
    forbidden(agent, "DELETE", custom_path("gkm.io", "v1alpha1", "gkmcachenodes", ns, node.name))
    forbidden(agent, "GET", f"/api/v1/namespaces/{ns}/secrets")
    forbidden(agent, "GET", "/api/v1/nodes")  # its own Node only: get and watch by name
    cached = cluster.objs.get_namespaced_custom_object("gkm.io", "v1alpha1", ns, "gkmcaches", "kernels")
    assert "resolvedDigest" not in (cached.get("status") or {})


def test_agent_process_reports_status(tmp_path, control_plane, cluster, images, kube_namespace, registry):
    from tests.rigs.simhost import SimHost
    from tests.csi.conftest import Daemon, free_ports
    from tests.agent.conftest import TPU_LABELS

    ns = kube_namespace
    name = cluster.make_node(TPU_LABELS)
    host = SimHost.preset(tmp_path / "host", "v5e-4")
    sock = tmp_path / "agent.sock"
    daemon = Daemon("agent", [
        "agent", "--store", str(tmp_path / "store"), "--socket", str(sock), "--plain-http",
        "--sysfs-root", str(host.sysfs_root), "--dev-root", str(host.dev_root),
        "--metrics-address", f"127.0.0.1:{free_ports(1)[0]}", "--log-format", "text",
        "--node-name", name, "--kubeconfig", str(control_plane.kubeconfig("agent"))], sock, tmp_path)
    cluster.cache("prefetched", images.shared, namespace=ns, node_selector={"cloud.google.com/gke-tpu-topology": "2x2"})
    daemon.start()
    try:
        assert entry_in("Extracted", cluster, name, ns, "prefetched", digest_of(images.shared)), daemon.log()
        st = eventually(lambda: cluster.node_status(name))
        assert st["gpus"] == [{"gpuType": "tpu/v5e", "ids": [0, 1, 2, 3]}]
    finally:
        assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize("doc, why", [
    ("apiVersion: v1\nkind: Config\n", "no current-context"),
    (yaml.safe_dump({"current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                     "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443"}}],
                     "users": [{"name": "u", "user": EXEC_USER}]}),
     "authenticates with 'exec', which this client does not run"),
])
def test_agent_refuses_a_bad_kubeconfig(tmp_path, doc, why):
    """At start, with exit code 3 (prerequisite) and the reason: never a daemon that retries anonymously."""
    bad = tmp_path / "kubeconfig"
    bad.write_text(doc)
    (tmp_path / "run").mkdir()
    out = subprocess.run(accelnode_cmd() + [
        "agent", "--store", str(tmp_path / "store"), "--socket", str(tmp_path / "run" / "a.sock"),
        "--metrics-address", "127.0.0.1:0", "--node-name", "n1", "--kubeconfig", str(bad)],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert why in out.stderr, out.stderr


def test_padded_cache_objects_do_not_grow_the_agent(tmp_path, control_plane, cluster, kube_namespace):
    """Issue 33: a tenant's GKMCaches whose pod template's ``affinity`` (it preserves unknown
    fields) is padded with {} to 1.2 MiB: 400,000 empty objects each, every one of them held by
    every agent in the cluster (its pod's limit is 256 Mi). The agent decodes each under
    KUBE_OBJECT, lists them a few at a time (KUBE_LIST_PAGE) and keeps of each only what it reads:
    the real agent process stays under RSS_BOUND_KIB with eight of them, listed and watched."""
    from tests.agent.conftest import TPU_LABELS
    from tests.csi.conftest import Daemon, free_ports
    from tests.fuzz.bombs import RSS_BOUND_KIB, vm_hwm

    name = cluster.make_node(TPU_LABELS)
    sock = tmp_path / "agent.sock"
    pad = {"padding": [{} for _ in range(400_000)]}

    def create(i: int, last: bool = False) -> None:
        # the last one is prefetched on this node: its entry in the node's status says the agent saw it
        cluster.objs.create_namespaced_custom_object("gkm.io", "v1alpha1", kube_namespace, "gkmcaches", body={
            "apiVersion": "gkm.io/v1alpha1", "kind": "GKMCache", "metadata": {
                "name": f"padded-{i}", "annotations": {"accelnode.io/prefetch": "true"} if last else {}},
            "spec": {"image": "127.0.0.1:1/team/cache@sha256:" + "7" * 64, "podTemplate": {"spec": {
                "affinity": pad, "nodeSelector": {"cloud.google.com/gke-tpu-topology": "2x2"}}}}},
            _request_timeout=60)
        if last:  # only the controller's pin is prefetched
            cluster.pin(kube_namespace, f"padded-{i}", "sha256:" + "7" * 64)

    for i in range(4):  # listed at start
        create(i)
    daemon = Daemon("agent", [
        "agent", "--store", str(tmp_path / "store"), "--socket", str(sock), "--plain-http",
        "--metrics-address", f"127.0.0.1:{free_ports(1)[0]}", "--log-format", "text",
        "--node-name", name, "--kubeconfig", str(control_plane.kubeconfig("agent"))], sock, tmp_path).start()
    try:
        for i in range(4, 8):  # watched
            create(i, last=i == 7)
        assert eventually(lambda: "padded-7" in ((cluster.node_status(name, kube_namespace) or {}).get("caches")
                                                 or {}), 60), daemon.log()[-3000:]
        peak = vm_hwm(daemon.proc.pid)
    finally:
        stopped = daemon.stop()
        for i in range(8):  # 10 MB in the session's etcd: a plain GET of all caches elsewhere would be over 4 MiB
            try:
                cluster.objs.delete_namespaced_custom_object("gkm.io", "v1alpha1", kube_namespace, "gkmcaches",
                                                             f"padded-{i}")
            except Exception:
                pass  # not created
        assert stopped == 0, daemon.log()[-3000:]
    print(f"agent peak RSS with 8 padded caches: {peak} KiB")
    assert peak < RSS_BOUND_KIB, f"the agent's peak RSS {peak} KiB"
