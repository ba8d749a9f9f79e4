"""``accelnode dra`` against a real kube-apiserver (resource.k8s.io/v1): its ResourceSlice, and
NodePrepareResources/NodeUnprepareResources as kubelet calls them (v1 and v1beta1)."""

from __future__ import annotations

import json
import os
import signal

import grpc

from accelnode import exitcodes, grpcutil
from device_plugin.dra import api
from tests.conftest import eventually
from tests.dra.conftest import DRIVER, SLICES, allocated_claim, claim_path, node_slices

ACCEL, TOPO = "cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"


def the_slice(admin, node, want=lambda s: True, timeout=20.0):
    """The node's devices slice, once the pool's two slices are there and it satisfies ``want``."""
    def get():
        items = {s["metadata"]["name"]: s for s in node_slices(admin, node)}
        s = items.get(f"{node}-{DRIVER}")
        return s if len(items) == 2 and f"{node}-{DRIVER}-chips" in items and want(s) else None
    return eventually(get, f"the ResourceSlices of {node}", timeout=timeout)


def names(s) -> list[str]:
    return [d["name"] for d in s["spec"]["devices"]]


def chips(s) -> list[str]:
    """The 1-chip devices of a slice."""
    return [d["name"] for d in s["spec"]["devices"] if d["attributes"]["chips"] == {"int": 1}]


def test_the_slice_follows_the_chips_and_comes_back_when_deleted(control_plane, admin, node, tpu_host, dra):
    host = tpu_host("v5e-4")
    n = node("dra-slices", {ACCEL: "tpu-v5-lite-podslice", TOPO: "2x2"})
    d = dra(host, n, control_plane.kubeconfig("admin"))
    d.start()
    s = the_slice(admin, n, lambda s: names(s) == ["tpu-0", "tpu-1", "tpu-2", "tpu-3", "tpu-0-1", "tpu-2-3",
                                                   "tpu-0-3"])
    assert s["metadata"]["name"] == f"{n}-{DRIVER}" and s["spec"]["driver"] == DRIVER
    assert (s["spec"]["pool"]["name"], s["spec"]["pool"]["resourceSliceCount"]) == (n, 2)
    (counters,) = [x for x in node_slices(admin, n) if x["metadata"]["name"] == f"{n}-{DRIVER}-chips"]
    assert counters["spec"]["pool"]["name"] == n and "devices" not in counters["spec"]
    assert counters["spec"]["sharedCounters"] == [
        {"name": "chips", "counters": {f"chip-{i}": {"value": "1"} for i in range(4)}}]
    (owner,) = s["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("Node", n)
    attrs = s["spec"]["devices"][0]["attributes"]
    assert attrs["topology"] == {"string": "2x2"} and attrs["accelerator"] == {"string": "tpu-v5-lite-podslice"}

    # kubelet wipes the node's slices when it starts: the plugin puts it back
    admin.request("DELETE", f"{SLICES}/{s['metadata']['name']}")
    back = the_slice(admin, n, lambda x: x["metadata"]["uid"] != s["metadata"]["uid"])
    assert names(back) == names(s)

    # a chip turns unhealthy: it and the blocks holding it stay, tainted, in a new pool
    # generation of both slices; and the taints go when it recovers
    chip = host.chips()[1]
    host.bump_aer_fatal(chip)
    # both slices of the pool in one new generation (written one after the other: waited for)
    sick = the_slice(admin, n, lambda x: [d["name"] for d in x["spec"]["devices"] if d.get("taints")]
                     == ["tpu-1", "tpu-0-1", "tpu-0-3"] and {
        y["spec"]["pool"]["generation"] for y in node_slices(admin, n)} == {x["spec"]["pool"]["generation"]})
    assert names(sick) == names(s)
    assert sick["spec"]["pool"]["generation"] > back["spec"]["pool"]["generation"]
    host.reset_aer(chip)
    the_slice(admin, n, lambda x: chips(x) == ["tpu-0", "tpu-1", "tpu-2", "tpu-3"] and len(names(x)) == 7
              and not any(d.get("taints") for d in x["spec"]["devices"]))


def test_registration_info_and_a_second_plugin_of_the_same_name_is_refused(control_plane, admin, node, tpu_host, dra):
    host = tpu_host("v5e-4")
    n = node("dra-reg")
    d = dra(host, n, control_plane.kubeconfig("admin"))
    d.start()
    with grpcutil.unix_channel(d.reg_socket) as ch:
        info = api.RegistrationStub(ch).GetInfo(api.InfoRequest(), timeout=5)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(d.endpoint))
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                                             "v1alpha1.DRAResourceHealth"]
    # a second instance in the same kubelet root, under its own rolling-update socket name: refused
    p2 = d.start("--pod-uid", "1234", wait=False)
    assert p2.proc.wait(30) == exitcodes.PREREQUISITE, p2.log()
    assert f"another DRA plugin already registered driver '{DRIVER}'" in p2.log()
    assert d.procs[0].proc.poll() is None and d.reg_socket.is_socket()
    # a stale socket of a dead plugin does not block a restart
    d.procs[0].proc.send_signal(signal.SIGKILL)
    d.procs[0].proc.wait()
    assert d.reg_socket.is_socket()
    d.start()


def test_prepare_and_unprepare_a_claim(control_plane, admin, node, tpu_host, dra, kube_namespace):
    host = tpu_host("v5e-4")
    n = node("dra-prepare", {ACCEL: "tpu-v5-lite-podslice", TOPO: "2x2"})
    d = dra(host, n, control_plane.kubeconfig("admin"))
    d.start()
    the_slice(admin, n)
    ns = kube_namespace
    uid = allocated_claim(admin, ns, "two", n, ["tpu-2", "tpu-3"])

    for version in ("v1.DRAPlugin", "v1beta1.DRAPlugin"):  # the second call finds it prepared
        got = d.prepare(ns, "two", uid, version)
        assert got.error == "", got.error
        assert [(x.pool_name, x.device_name, list(x.request_names), list(x.cdi_device_ids)) for x in got.devices] == [
            (n, f"tpu-{i}", ["tpu"], [f"k8s.{DRIVER}/tpu={uid}-tpu-{i}"]) for i in (2, 3)]
    spec_file = d.cdi / f"k8s.{DRIVER}-tpu_{uid}.json"
    spec = json.loads(spec_file.read_text())
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env["TPU_TOPOLOGY"] == "2x2" and env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,2,1"
    assert [dev["name"] for dev in spec["devices"]] == [f"{uid}-tpu-2", f"{uid}-tpu-3"]

    # crash-safe: a plugin killed between prepare and unprepare, the claim gone from the API server
    # meanwhile (so nothing could be read again): a restarted plugin still answers from its state
    d.procs[0].proc.send_signal(signal.SIGKILL)
    d.procs[0].proc.wait()
    admin.request("DELETE", claim_path(ns, "two"))
    d.start()
    again = d.prepare(ns, "two", uid)
    assert again.error == "" and [x.device_name for x in again.devices] == ["tpu-2", "tpu-3"]
    assert d.unprepare(ns, "two", uid).error == ""
    assert not spec_file.exists() and not list((d.root / "plugins" / DRIVER / "claims").iterdir())
    assert d.unprepare(ns, "two", uid).error == ""  # twice: nothing to do, no error


def test_claims_that_cannot_be_prepared_say_why_and_write_nothing(control_plane, admin, node, tpu_host, dra,
                                                                   kube_namespace):
    host = tpu_host("v5e-4")
    n = node("dra-refuse")
    d = dra(host, n, control_plane.kubeconfig("admin"))
    d.start()
    ns = kube_namespace
    other = allocated_claim(admin, ns, "elsewhere", "another-node", ["tpu-0"])
    assert "has no device of tpu.google.com in pool dra-refuse" in d.prepare(ns, "elsewhere", other).error
    assert "not found" in d.prepare(ns, "missing", "0f0e0d0c-0000-4000-8000-00000000000f").error
    wrong = allocated_claim(admin, ns, "wrong-uid", n, ["tpu-0"])
    assert "kubelet asked for" in d.prepare(ns, "wrong-uid", wrong[:-1] + ("1" if wrong.endswith("0") else "0")).error
    assert "not a UID" in d.prepare(ns, "wrong-uid", "../../etc/passwd").error
    absent = allocated_claim(admin, ns, "absent", n, ["tpu-7"])
    assert "device tpu-7 is not on this node" in d.prepare(ns, "absent", absent).error
    host.bump_aer_fatal(host.chips()[0])
    the_slice(admin, n, lambda x: any(d["name"] == "tpu-0" and d.get("taints") for d in x["spec"]["devices"]))
    sick = allocated_claim(admin, ns, "sick", n, ["tpu-0"])
    assert "chip tpu-0 is Unhealthy" in d.prepare(ns, "sick", sick).error
    assert not list(d.cdi.glob("*.json"))
    assert not list((d.root / "plugins" / DRIVER / "claims").glob("*.json"))


def two_claims(control_plane, admin, node, tpu_host, dra, ns: str, node_name: str):
    """A plugin on a v5e-4 host and claims a (tpu-0) and b (tpu-1) allocated on its node: (plugin, a, b)."""
    n = node(node_name)
    d = dra(tpu_host("v5e-4"), n, control_plane.kubeconfig("admin"))
    d.start()
    return d, allocated_claim(admin, ns, "a", n, ["tpu-0"]), allocated_claim(admin, ns, "b", n, ["tpu-1"])


def test_prepare_of_several_claims_answers_each(control_plane, admin, node, tpu_host, dra, kube_namespace):
    ns = kube_namespace
    d, a, b = two_claims(control_plane, admin, node, tpu_host, dra, ns, "dra-many")
    pb, _ = api.SERVICES["v1.DRAPlugin"]
    req = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=ns, name="a", uid=a),
                                                 pb.Claim(namespace=ns, name="missing", uid=b[:-1] + "0"),
                                                 pb.Claim(namespace=ns, name="b", uid=b)])
    got = d.stub().NodePrepareResources(req, timeout=45).claims
    assert set(got) == {a, b, b[:-1] + "0"}
    assert got[a].devices[0].device_name == "tpu-0" and got[b].devices[0].device_name == "tpu-1"
    assert "not found" in got[b[:-1] + "0"].error
    try:
        d.stub("v1.DRAPlugin").NodePrepareResources(pb.NodePrepareResourcesRequest(), timeout=5)
    except grpc.RpcError as e:  # an empty request is no error either
        raise AssertionError(e) from None
    assert os.path.exists(d.cdi / f"k8s.{DRIVER}-tpu_{a}.json")


def test_a_checkpoint_that_does_not_parse_fails_no_other_claim(control_plane, admin, node, tpu_host, dra,
                                                              kube_namespace):
    """A corrupt checkpoint (a torn disk write, a bad restore) is that claim's alone: the claims
    prepared beside it in one call are answered, and the claim itself is prepared anew from the
    API server. On main the JSON error escaped the handler: the whole call failed (UNKNOWN)."""
    ns = kube_namespace
    d, a, b = two_claims(control_plane, admin, node, tpu_host, dra, ns, "dra-corrupt")
    for name, uid in (("a", a), ("b", b)):
        assert d.prepare(ns, name, uid).error == ""
    claims = d.root / "plugins" / DRIVER / "claims"
    (claims / f"{a}.json").write_bytes(b'{"devices": [')  # torn
    (claims / f"{b}.json").write_text(json.dumps({"uid": b, "devices": "tpu-1"}))  # not a list of devices
    pb, _ = api.SERVICES["v1.DRAPlugin"]
    for _ in range(2):  # the second call reads the checkpoints it rewrote
        got = d.stub().NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[
            pb.Claim(namespace=ns, name="a", uid=a), pb.Claim(namespace=ns, name="b", uid=b)]), timeout=45).claims
        assert (got[a].error, got[b].error) == ("", "")
        assert [x.device_name for x in got[a].devices] == ["tpu-0"] and [x.device_name for x in got[b].devices] == [
            "tpu-1"]
    assert json.loads((claims / f"{a}.json").read_text())["uid"] == a
    assert "claim checkpoint unreadable" in d.procs[-1].log()


def test_prepare_reads_the_allocation_from_the_claim_watch(control_plane, admin, node, tpu_host, dra, tmp_path,
                                                           kube_namespace):
    """The plugin follows this node's claims with a watch and prepares from it, without a GET per
    call: under an account that may list and watch claims but not get one, a claim allocated on
    its node is prepared (once the watch has brought it), while a claim the watch cannot answer
    for (not allocated here) falls back to the GET, which that account is refused."""
    sa, ns = "dra-watch-only", kube_namespace
    rules = [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list", "watch"]},
             {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "watch"]}]
    admin.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", body={
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    admin.request("POST", f"{rbac}/clusterroles", body={
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": sa}, "rules": rules})
    admin.request("POST", f"{rbac}/clusterrolebindings", body={
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": sa},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": sa},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})
    try:
        token = admin.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", body={
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600}})["status"]["token"]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{control_plane.port}",
                                                   "certificate-authority": str(control_plane.ca_file)}}],
            "users": [{"name": "u", "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        n = node("dra-watched")
        d = dra(tpu_host("v5e-4"), n, kubeconfig)
        d.start("--claim-watch")
        uid = allocated_claim(admin, ns, "seen", n, ["tpu-0", "tpu-1"])
        (got,) = eventually(lambda: [r for r in [d.prepare(ns, "seen", uid)] if r.error == ""],
                            "the claim prepared from the watch", timeout=20)
        assert [(x.pool_name, x.device_name, list(x.request_names)) for x in got.devices] == [
            (n, "tpu-0", ["tpu"]), (n, "tpu-1", ["tpu"])]
        assert os.path.exists(d.cdi / f"k8s.{DRIVER}-tpu_{uid}.json")
        assert "allocation_from=watch" in d.procs[-1].log()
        elsewhere = allocated_claim(admin, ns, "elsewhere", "another-node", ["tpu-2"])
        why = d.prepare(ns, "elsewhere", elsewhere).error
        assert "reading it failed" in why and "403" in why, why  # the fallback GET, refused to this account
        assert d.unprepare(ns, "seen", uid).error == ""
    finally:
        admin.request("DELETE", f"{rbac}/clusterrolebindings/{sa}")
        admin.request("DELETE", f"{rbac}/clusterroles/{sa}")
