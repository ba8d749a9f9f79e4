"""The GCE Compute emulator (tests/rigs/gce.py) as the controller's client sees it
(controller/nodegroups/compute.py over google-cloud-compute), and as raw REST: bodies checked against Google's
discovery document, GCE's error JSON, paging, fingerprints, operations, faults."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import uuid
import urllib.request

import pytest

from tests.rigs.gce import BASE, Server
from controller.nodegroups.compute import GCE, GCEError, Owner
from tests.csi.conftest import free_ports

P, R, Z = "my-tpu-project", "us-east5", "us-east5-b"


@pytest.fixture
def srv():
    s = Server().start()
    yield s
    s.stop()


OWNER = Owner("cluster-uid", "group-uid", "ns/g")


def rid() -> str:
    return str(uuid.uuid4())


def post(srv, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.endpoint + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def make_group(gce: GCE, size: int = 3, mode: str = "BULK") -> None:
    gce.insert_policy(P, R, "pol", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())
    gce.insert_template(P, "tmpl", {"machineType": "tpu7x-standard-4t", "provisioningModel": "SPOT"}, {"a": "b"},
                        OWNER, rid())
    gce.insert_mig(P, Z, "mig", {"instanceTemplate": f"{BASE}projects/{P}/global/instanceTemplates/tmpl",
                                 "targetSize": size, "targetSizePolicyMode": mode,
                                 "workloadPolicy": f"{BASE}projects/{P}/regions/{R}/resourcePolicies/pol"},
                   OWNER, rid())


def test_a_body_field_the_discovery_document_does_not_know_is_refused(srv):
    code, body = post(srv, f"/compute/v1/projects/{P}/regions/{R}/resourcePolicies",
                      {"name": "p", "workloadPolicy": {"type": "HIGH_THROUGHPUT", "topology": "2x2"}})
    assert code == 400
    err = body["error"]
    assert err["code"] == 400 and err["errors"][0]["reason"] == "invalid" and '"topology"' in err["message"]
    code, body = post(srv, f"/compute/v1/projects/{P}/regions/{R}/resourcePolicies",
                      {"name": "p", "workloadPolicy": {"type": "SOMETIMES"}})
    assert code == 400 and "SOMETIMES" in body["error"]["message"]
    assert srv.compute.resources == {}


def test_the_official_client_creates_pages_and_reads(srv):
    gce = GCE(srv.endpoint)
    make_group(gce, size=3)
    mig = gce.get_mig(P, Z, "mig")
    assert mig.status.is_stable and mig.target_size_policy.mode == "BULK"
    srv.compute.faults.boot_s = 0
    # pages of one: the client follows nextPageToken
    import google.cloud.compute_v1 as c
    req = c.ListManagedInstancesInstanceGroupManagersRequest(project=P, zone=Z, instance_group_manager="mig",
                                                             max_results=1)
    pages = list(gce._client("InstanceGroupManagersClient").list_managed_instances(request=req).pages)
    assert len(pages) == 3 and all(len(p.managed_instances) == 1 for p in pages)
    assert len(gce.managed_instances(P, Z, "mig")) == 3
    assert gce.get_policy(P, R, "nope") is None
    tmpl = gce.get_template(P, "tmpl")
    assert tmpl.properties.scheduling.instance_termination_action == "STOP"


def test_metadata_fingerprints_and_412(srv):
    gce = GCE(srv.endpoint)
    make_group(gce, size=1, mode="INDIVIDUAL")
    (mi,) = gce.managed_instances(P, Z, "mig")
    inst = gce.get_instance(P, Z, mi.instance.rsplit("/", 1)[1])
    gce.set_metadata(P, Z, inst.name, inst.metadata.fingerprint, {"k": "v"})
    with pytest.raises(GCEError) as err:
        gce.set_metadata(P, Z, inst.name, inst.metadata.fingerprint, {"k": "w"})
    assert err.value.code == 412 and err.value.terminal
    after = gce.get_instance(P, Z, inst.name)
    assert {i.key: i.value for i in after.metadata.items} == {"k": "v"}
    assert after.metadata.fingerprint != inst.metadata.fingerprint


def test_operations_run_slow_and_fail_with_gce_errors(srv):
    gce = GCE(srv.endpoint)
    srv.compute.set_faults(op_delay_s=0.3)
    name = gce.insert_policy(P, R, "pol", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())
    assert not gce.operation("regions", P, R, name).done
    time.sleep(0.35)
    assert gce.operation("regions", P, R, name).done
    srv.compute.set_faults(op_delay_s=0)
    gce.insert_template(P, "tmpl", {"machineType": "ct6e-standard-4t"}, {}, OWNER, rid())
    gce.insert_mig(P, Z, "mig", {"instanceTemplate": f"{BASE}projects/{P}/global/instanceTemplates/tmpl",
                                 "targetSize": 1}, OWNER, rid())
    with pytest.raises(GCEError):  # in use by the MIG: the delete's operation... or the call, fails
        op = gce.delete_template(P, "tmpl")
        o = gce.operation("global", P, "", op)
        raise GCEError(o.error_code, o.error_message) if o.error_code else AssertionError("deleted while in use")


def test_faults_503_and_one_shot_errors(srv):
    gce = GCE(srv.endpoint)
    srv.compute.set_faults(unavailable=1, errors=[{"path": "/resourcePolicies$", "code": 429, "reason":
                                                   "rateLimitExceeded"}])
    with pytest.raises(GCEError) as err:
        gce.get_policy(P, R, "p")
    assert err.value.code == 503 and not err.value.terminal
    with pytest.raises(GCEError) as err:
        gce.insert_policy(P, R, "p", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())
    assert err.value.code == 429 and not err.value.terminal
    gce.insert_policy(P, R, "p", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())  # and then it works


def test_stuck_provisioning_and_bulk_unplaceable(srv):
    gce = GCE(srv.endpoint)
    srv.compute.set_faults(stuck_provisioning=True)
    make_group(gce, size=2)
    assert {mi.instance_status for mi in gce.managed_instances(P, Z, "mig")} == {"PROVISIONING"}
    assert not gce.get_mig(P, Z, "mig").status.is_stable
    srv.compute.set_faults(bulk_unplaceable=True, stuck_provisioning=False)
    gce.insert_mig(P, Z, "mig2", {"instanceTemplate": f"{BASE}projects/{P}/global/instanceTemplates/tmpl",
                                  "targetSize": 2, "targetSizePolicyMode": "BULK"}, OWNER, rid())
    mis = gce.managed_instances(P, Z, "mig2")
    assert [e.code for mi in mis for e in mi.last_attempt.errors.errors] == ["ZONE_RESOURCE_POOL_EXHAUSTED"] * 2
    assert len(srv.compute.instances(P)) == 2  # only mig's


def test_the_emulator_runs_standalone():
    (port,) = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "tests.rigs.gce", "--port", str(port), "--op-delay", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"GCE emulator on http://127.0.0.1:{port}"
        gce = GCE(f"http://127.0.0.1:{port}")
        gce.insert_policy(P, R, "p", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())
        assert gce.get_policy(P, R, "p").workload_policy.accelerator_topology == "2x2x2"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_repeated_request_id_answers_the_first_operation_and_vms_carry_their_origin(srv):
    """What crash recovery and the ownership checks rest on, as GCE does it: an insert repeated
    with its requestId (its answer lost) gets the first operation back and makes nothing twice;
    a MIG's VMs carry the template's labels and the MIG in metadata created-by."""
    gce = GCE(srv.endpoint)
    srv.compute.set_faults(op_delay_s=0.3)
    req = rid()
    first = gce.insert_template(P, "tmpl", {"machineType": "ct6e-standard-4t"}, {"a": "b"}, OWNER, req)
    assert gce.insert_template(P, "tmpl", {"machineType": "ct6e-standard-4t"}, {"a": "b"}, OWNER, req) == first
    with pytest.raises(GCEError) as err:  # exists: a new request id is a conflict
        time.sleep(0.35)
        gce.insert_template(P, "tmpl", {"machineType": "ct6e-standard-4t"}, {}, OWNER, rid())
    assert err.value.code == 409
    assert OWNER.owns(gce.get_template(P, "tmpl"))
    assert not Owner("cluster-uid", "another-group").owns(gce.get_template(P, "tmpl"))
    srv.compute.set_faults(op_delay_s=0)
    gce.insert_mig(P, Z, "mig", {"instanceTemplate": f"{BASE}projects/{P}/global/instanceTemplates/tmpl",
                                 "targetSize": 1}, OWNER, rid())
    assert OWNER.owns(gce.get_mig(P, Z, "mig"))
    (inst,) = srv.compute.instances(P)
    assert inst["labels"] == OWNER.labels
    md = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
    assert md["created-by"].endswith(f"/zones/{Z}/instanceGroupManagers/mig") and md["a"] == "b"


def test_an_operation_can_fail_late(srv):
    gce = GCE(srv.endpoint)
    srv.compute.set_faults(fail_ops=[{"type": "insert", "path": "/resourcePolicies/late$", "code": 503}])
    op = gce.insert_policy(P, R, "late", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())  # accepted
    o = gce.operation("regions", P, R, op)
    assert o.done and o.error_code == 503
    assert gce.get_policy(P, R, "late") is None
    gce.insert_policy(P, R, "late", "HIGH_THROUGHPUT", "2x2x2", OWNER, rid())  # once only
    assert gce.get_policy(P, R, "late") is not None
