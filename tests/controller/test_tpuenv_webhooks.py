"""The TPU environment webhooks as the real kube-apiserver calls them, on the objects the real
kube-controller-manager creates, and what JAX's own cluster detection derives from them.

The webhook configuration is daemonsets/webhooks-tpu-env.yaml as shipped, with each
``clientConfig`` pointed at our AdmissionServer on 127.0.0.1 (a test CA's ``caBundle``) and the
``namespaceSelector`` narrowed to this module's namespace. The StatefulSet is the upstream
injector's README example (web / nginx, 3 replicas, a FOO variable) with
``podManagementPolicy: Parallel`` (no kubelet runs: OrderedReady would wait for web-0 to be
Ready); the Indexed Job is GKE's example shape; the JobSet is two Jobs as the JobSet controller
creates them (names and labels). Pods stay Pending: their env is read from the Pod objects.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from controller.webhooks.server import AdmissionServer
from controller.tpuenv.webhooks import routes
from controller.tpuenv.patches import INJECT_LABEL, STATE_ANNOTATION
from tests.controller.test_webhook_server import CA
from tests.controlplane.test_controllers import eventually

ROOT = Path(__file__).resolve().parents[2]
JAX_DETECT = Path(__file__).with_name("jax_detect.py")
OPT_IN = {INJECT_LABEL: "enabled"}


@pytest.fixture(scope="module")
def env(control_plane, kube_api, tmp_path_factory):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    admin = kube_api("admin")
    run = uuid.uuid4().hex[:8]
    ns = f"tpuenv-{run}"
    ca = CA()
    cert, key, _ = ca.serving(tmp_path_factory.mktemp("tpuenv"), "accelnode-controller")
    server = AdmissionServer("127.0.0.1:0", cert, key, routes()).start()
    core, reg = client.CoreV1Api(admin), client.AdmissionregistrationV1Api(admin)
    core.create_namespace(body={"metadata": {"name": ns, "labels": {"accelnode.io/tpuenv-test": run}}})
    [config] = yaml.safe_load_all((ROOT / "daemonsets" / "webhooks-tpu-env.yaml").read_text())
    config["metadata"]["name"] = f"test-tpu-env-{run}"
    for hook in config["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{server.port}{path}",
                                "caBundle": base64.b64encode(ca.pem).decode()}
        hook["namespaceSelector"] = {"matchLabels": {"accelnode.io/tpuenv-test": run}}
    reg.create_mutating_webhook_configuration(body=config)
    apps, batch = client.AppsV1Api(admin), client.BatchV1Api(admin)
    try:
        # the API server picks configurations up asynchronously: dry-run until the hook answers
        def active():
            sts = apps.create_namespaced_stateful_set(ns, statefulset("probe", "probe", 1), dry_run="All")
            return any(e.name == "TPU_WORKER_HOSTNAMES" for e in sts.spec.template.spec.containers[0].env or [])
        eventually(active, "the StatefulSet webhook is called by the API server", timeout=60)
        yield {"ns": ns, "core": core, "apps": apps, "batch": batch, "server": server, "run": run}
    finally:
        try:
            reg.delete_mutating_webhook_configuration(config["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 404:
                raise
        server.stop()


def statefulset(name: str, service: str, replicas: int) -> dict:
    """The upstream injector's README example."""
    labels = {"app": name, **OPT_IN}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "labels": dict(OPT_IN)},
            "spec": {"serviceName": service, "replicas": replicas, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "nginx", "image": "registry.k8s.io/nginx-slim:0.8",
                                                           "ports": [{"containerPort": 80, "name": "web"}],
                                                           "env": [{"name": "FOO", "value": "bar"}]}]}}}}


def indexed_job(name: str, subdomain: str, parallelism: int, *, labels=None, containers=1,
                accelerator="tpu-v5p-slice") -> dict:
    """GKE's Indexed-Job example shape (``containers`` TPU containers per pod)."""
    cs = [{"name": f"tpu-job-{i}" if i else "tpu-job", "image": "python:3.10",
           "ports": [{"containerPort": 8471}, {"containerPort": 8431}],
           "securityContext": {"privileged": True},
           "command": ["bash", "-c", "python -c 'import jax; print(jax.device_count())'"],
           "resources": {"requests": {"google.com/tpu": "4"}, "limits": {"google.com/tpu": "4"}}}
          for i in range(containers)]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"backoffLimit": 0, "completions": parallelism, "parallelism": parallelism,
                     "completionMode": "Indexed",
                     "template": {"spec": {"subdomain": subdomain, "restartPolicy": "Never",
                                           "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                                            "cloud.google.com/gke-tpu-topology": "2x2x2"},
                                           "containers": cs}}}}


def jobset_jobs(jobset: str, rjob: str, slices: int, hosts: int, **kw) -> list[dict]:
    """The Jobs the JobSet controller creates for one replicatedJob of ``slices`` replicas."""
    out = []
    for i in range(slices):
        labels = {"jobset.sigs.k8s.io/jobset-name": jobset, "jobset.sigs.k8s.io/replicatedjob-name": rjob,
                  "jobset.sigs.k8s.io/job-index": str(i), "jobset.sigs.k8s.io/replicatedjob-replicas": str(slices),
                  "jobset.sigs.k8s.io/job-global-index": str(i), "jobset.sigs.k8s.io/global-replicas": str(slices),
                  "jobset.sigs.k8s.io/job-key": uuid.uuid4().hex}
        job = indexed_job(f"{jobset}-{rjob}-{i}", jobset, hosts, labels=labels, **kw)
        job["spec"]["template"]["metadata"] = {"labels": dict(labels), "annotations": dict(labels)}
        out.append(job)
    return out


def env_of(container) -> dict[str, str]:
    names = [e.name for e in container.env or []]
    assert len(names) == len(set(names)), f"duplicate variables in {container.name}: {names}"
    # the Job controller adds JOB_COMPLETION_INDEX from a fieldRef: only literal values here
    return {e.name: e.value for e in container.env or [] if e.value_from is None}


def pods_of(e, selector: str, n: int) -> list:
    def pods():
        items = e["core"].list_namespaced_pod(e["ns"], label_selector=selector).items
        return items if len(items) == n else None
    return eventually(pods, f"{n} pods for {selector}")


def jax_view(processes: list[dict]) -> list[dict]:
    """JAX's derivation for each process environment (tests/controller/jax_detect.py)."""
    hosts = set()
    for p in processes:
        for key in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
            hosts |= {h.split(":")[0] for h in p.get(key, "").split(",") if h}
        if "MEGASCALE_COORDINATOR_ADDRESS" in p:
            hosts.add(p["MEGASCALE_COORDINATOR_ADDRESS"].split(":")[0])
    out = subprocess.run([sys.executable, str(JAX_DETECT)], input=json.dumps({"processes": processes,
                                                                               "hosts": sorted(hosts)}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_statefulset_readme_example(env):
    e, ns = env, env["ns"]
    e["core"].create_namespaced_service(ns, body={"metadata": {"name": "nginx"}, "spec": {
        "clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"app": "web"},
        "ports": [{"port": 80, "name": "web"}]}})
    e["apps"].create_namespaced_stateful_set(ns, statefulset("web", "nginx", 3))
    pods = sorted(pods_of(e, "app=web", 3), key=lambda p: p.metadata.name)
    hosts = "web-0.nginx,web-1.nginx,web-2.nginx"
    processes = []
    for i, pod in enumerate(pods):
        [c] = pod.spec.containers
        # the upstream integration test's assertion: FOO first, TPU_WORKER_HOSTNAMES next
        assert [v.name for v in c.env][:2] == ["FOO", "TPU_WORKER_HOSTNAMES"]
        got = env_of(c)
        assert got["FOO"] == "bar" and got["TPU_WORKER_HOSTNAMES"] == hosts
        assert got["TPU_WORKER_ID"] == str(i)
        assert got["MEGASCALE_NUM_SLICES"] == "1" and got["MEGASCALE_SLICE_ID"] == "0"
        processes.append(got)
    assert [(v["process_id"], v["process_count"], v["coordinator"], v["cluster"]) for v in jax_view(processes)] == [
        (i, 3, "web-0.nginx:8482", "GkeTpuCluster") for i in range(3)]

    # a second write of the live object changes nothing: no duplicate, no new revision
    sts = e["apps"].read_namespaced_stateful_set("web", ns)
    before = sts.spec.template.spec.containers[0].env
    again = e["apps"].replace_namespaced_stateful_set("web", ns, sts)
    assert again.spec.template.spec.containers[0].env == before
    assert again.metadata.generation == sts.metadata.generation

    # a scale through UPDATE recomputes the hostnames; the new worker gets id 3 of 4
    e["apps"].patch_namespaced_stateful_set("web", ns, {"spec": {"replicas": 4}})
    sts = e["apps"].read_namespaced_stateful_set("web", ns)
    assert env_of(sts.spec.template.spec.containers[0])["TPU_WORKER_HOSTNAMES"] == hosts + ",web-3.nginx"
    pod = eventually(lambda: next((p for p in pods_of(e, "app=web", 4) if p.metadata.name == "web-3"), None),
                     "web-3")
    got = env_of(pod.spec.containers[0])
    assert got["TPU_WORKER_ID"] == "3" and got["TPU_WORKER_HOSTNAMES"] == hosts + ",web-3.nginx"


def test_statefulset_ordinals_start_and_a_users_own_value(env):
    e, ns = env, env["ns"]
    sts = statefulset("ord", "ordsvc", 2)
    sts["spec"]["ordinals"] = {"start": 5}
    sts["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "MEGASCALE_PORT", "value": "9999"})
    e["apps"].create_namespaced_stateful_set(ns, sts)
    pods = sorted(pods_of(e, "app=ord", 2), key=lambda p: p.metadata.name)
    assert [p.metadata.name for p in pods] == ["ord-5", "ord-6"]
    for i, pod in enumerate(pods):
        got = env_of(pod.spec.containers[0])
        assert got["TPU_WORKER_HOSTNAMES"] == "ord-5.ordsvc,ord-6.ordsvc"
        assert got["TPU_WORKER_ID"] == str(i)
        assert got["MEGASCALE_PORT"] == "9999"  # the user's, never overwritten
    record = json.loads(pods[0].metadata.annotations[STATE_ANNOTATION])
    assert record["start"] == 5 and "MEGASCALE_PORT" not in record["vars"]


def test_indexed_job_gke_example(env):
    e, ns = env, env["ns"]
    e["batch"].create_namespaced_job(ns, indexed_job("tpu-job-podslice", "headless-svc", 4))
    pods = pods_of(e, "batch.kubernetes.io/job-name=tpu-job-podslice", 4)
    pods.sort(key=lambda p: int(p.metadata.labels["batch.kubernetes.io/job-completion-index"]))
    hosts = ",".join(f"tpu-job-podslice-{i}.headless-svc" for i in range(4))
    processes = []
    for i, pod in enumerate(pods):
        got = env_of(pod.spec.containers[0])
        assert got["TPU_WORKER_HOSTNAMES"] == hosts and got["TPU_WORKER_ID"] == str(i)
        assert "TPU_PROCESS_ADDRESSES" not in got  # not TPU7x
        processes.append(got)
    assert [(v["process_id"], v["process_count"], v["coordinator"]) for v in jax_view(processes)] == [
        (i, 4, "tpu-job-podslice-0.headless-svc:8482") for i in range(4)]


@pytest.mark.parametrize("example", ["injector-readme-statefulset.yaml", "gke-indexed-job.yaml"])
def test_the_shipped_examples_unchanged(env, kubectl, example):
    """examples/tpu-env/ as users have them (the injector's README, GKE's Indexed Job), created
    as they are with kubectl in a namespace of their own: the API server's answer carries our
    variables, and so do the pods the controllers make."""
    e = env
    ns = f"{e['ns']}-{example.split('-')[0]}"
    e["core"].create_namespace(body={"metadata": {"name": ns, "labels": {"accelnode.io/tpuenv-test": e["run"]}}})
    out = kubectl("admin", "create", "-n", ns, "-o", "json", "-f", f"examples/tpu-env/{example}")
    assert out.returncode == 0, out.stderr
    made, text, at = {}, out.stdout, 0
    while text[at:].strip():  # one JSON object per created object
        obj, at = json.JSONDecoder().raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        made[obj["kind"]] = obj
    if "StatefulSet" in made:
        [c] = made["StatefulSet"]["spec"]["template"]["spec"]["containers"]
        assert [v["name"] for v in c["env"]][:2] == ["FOO", "TPU_WORKER_HOSTNAMES"]
        assert c["env"][1]["value"] == "web-0.nginx,web-1.nginx,web-2.nginx"
        web0 = eventually(lambda: next((p for p in e["core"].list_namespaced_pod(ns, label_selector="app=nginx").items
                                        if p.metadata.name == "web-0"), None), "web-0")
        got = env_of(web0.spec.containers[0])
        assert got["TPU_WORKER_ID"] == "0" and got["FOO"] == "bar"
    else:
        got = {v["name"]: v.get("value") for v in made["Job"]["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert got["TPU_WORKER_HOSTNAMES"] == ",".join(f"tpu-job-podslice-{i}.headless-svc" for i in range(4))
        pods = pods_of({**e, "ns": ns}, "batch.kubernetes.io/job-name=tpu-job-podslice", 4)
        assert sorted(env_of(p.spec.containers[0])["TPU_WORKER_ID"] for p in pods) == ["0", "1", "2", "3"]


def test_jobs_outside_gkes_rule_pass_untouched(env):
    e, ns = env, env["ns"]
    single = indexed_job("one-host", "svc", 1)
    plain = indexed_job("nonindexed", "svc", 2)
    del plain["spec"]["completionMode"]
    for job in (single, plain):
        made = e["batch"].create_namespaced_job(ns, job)
        assert not made.spec.template.spec.containers[0].env
        assert STATE_ANNOTATION not in (made.spec.template.metadata.annotations or {})
    pods = pods_of(e, "batch.kubernetes.io/job-name=one-host", 1)
    assert env_of(pods[0].spec.containers[0]) == {}
    # a labelled pod of no workload (no owner, no template annotation) is not ours either
    pod = e["core"].create_namespaced_pod(ns, {"metadata": {"name": "bare", "labels": dict(OPT_IN)},
                                               "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    assert not pod.spec.containers[0].env


def test_jobset_multislice(env):
    e, ns = env, env["ns"]
    for job in jobset_jobs("js", "slice", 2, 4):
        e["batch"].create_namespaced_job(ns, job)
    pods = pods_of(e, "jobset.sigs.k8s.io/jobset-name=js", 8)
    key = lambda p: (int(p.metadata.labels["jobset.sigs.k8s.io/job-index"]),  # noqa: E731
                     int(p.metadata.labels["batch.kubernetes.io/job-completion-index"]))
    pods.sort(key=key)
    processes = []
    for pod in pods:
        s, i = key(pod)
        got = env_of(pod.spec.containers[0])
        assert got["TPU_WORKER_HOSTNAMES"] == ",".join(f"js-slice-{s}-{w}.js" for w in range(4))
        assert (got["TPU_WORKER_ID"], got["MEGASCALE_SLICE_ID"], got["MEGASCALE_NUM_SLICES"]) == (str(i), str(s), "2")
        assert got["MEGASCALE_COORDINATOR_ADDRESS"] == "js-slice-0-0.js" and got["MEGASCALE_PORT"] == "8080"
        processes.append(got)
    assert [(v["process_id"], v["process_count"], v["coordinator"]) for v in jax_view(processes)] == [
        (n, 8, "js-slice-0-0.js:8482") for n in range(8)]


def test_tpu7x_two_processes_per_pod_in_two_slices(env):
    e, ns = env, env["ns"]
    for job in jobset_jobs("v7", "w", 2, 2, containers=2, accelerator="tpu7x"):
        e["batch"].create_namespaced_job(ns, job)
    pods = pods_of(e, "jobset.sigs.k8s.io/jobset-name=v7", 4)
    key = lambda p: (int(p.metadata.labels["jobset.sigs.k8s.io/job-index"]),  # noqa: E731
                     int(p.metadata.labels["batch.kubernetes.io/job-completion-index"]))
    processes, expect = [], []
    for pod in sorted(pods, key=key):
        s, i = key(pod)
        for n, c in enumerate(pod.spec.containers):
            got = env_of(c)
            assert got["TPU_PROCESS_ADDRESSES"] == ",".join(f"v7-w-{s}-{w}.v7:{8476 + k}" for w in range(2)
                                                            for k in range(2))
            assert (got["TPU_WORKER_ID"], got["TPU_PROCESS_PORT"]) == (str(2 * i + n), str(8476 + n))
            processes.append(got)
            expect.append((s * 4 + 2 * i + n, 8, "v7-w-0-0.v7:8482"))
    # JAX: one process per container, 4 per slice, ids 0..7 across the two slices
    assert [(v["process_id"], v["process_count"], v["coordinator"]) for v in jax_view(processes)] == expect


def test_hostile_requests_from_the_apiserver_side(env):
    """An Indexed TPU Job whose JobSet labels contradict each other is refused with the reason."""
    from kubernetes.client.rest import ApiException

    e = env
    [job] = jobset_jobs("bad", "r", 1, 2)
    job["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"] = "3"
    with pytest.raises(ApiException) as info:
        e["batch"].create_namespaced_job(e["ns"], copy.deepcopy(job))
    assert info.value.status == 422 and "job-index" in info.value.body


def test_scale_through_the_scale_subresource_is_caught_up_by_the_reconciler(env, control_plane, kubectl):
    """``/scale`` carries no template, so no webhook can fix the hostnames: the reconciler
    (running in-process as the controller identity, with daemonsets/rbac-controller-tpuenv.yaml)
    writes the template, once; the new pod then gets an id the hostnames name."""
    from prometheus_client import CollectorRegistry

    from accelnode.kube.client import Client, Config
    from controller.runtime.runner import Controller, Metrics
    from controller.runtime.queue import Backoff
    from controller.tpuenv.scale import statefulset_env_reconciler

    e, ns = env, env["ns"]
    out = kubectl("admin", "apply", "-f", str(ROOT / "daemonsets/namespace.yaml"),
                  "-f", str(ROOT / "daemonsets/rbac-controller-tpuenv.yaml"))
    assert out.returncode == 0, out.stderr
    e["apps"].create_namespaced_stateful_set(ns, statefulset("sc", "scsvc", 2))
    pods_of(e, "app=sc", 2)
    e["apps"].patch_namespaced_stateful_set_scale("sc", ns, {"spec": {"replicas": 3}})
    me = Client(Config.from_kubeconfig(control_plane.kubeconfig("controller")), user_agent="accelnode-controller")
    ctl = Controller(me, statefulset_env_reconciler(me), Metrics(CollectorRegistry()), workers=1, resync=0.5,
                     backoff=Backoff(0.2, 2.0)).start()
    try:
        want = "sc-0.scsvc,sc-1.scsvc,sc-2.scsvc"
        eventually(lambda: env_of(e["apps"].read_namespaced_stateful_set("sc", ns).spec.template.spec.containers[0])
                   .get("TPU_WORKER_HOSTNAMES") == want, "the reconciler rewrites the hostnames")
        pod = eventually(lambda: next((p for p in pods_of(e, "app=sc", 3) if p.metadata.name == "sc-2"), None),
                         "sc-2")
        got = env_of(pod.spec.containers[0])
        assert (got["TPU_WORKER_ID"], got["TPU_WORKER_HOSTNAMES"]) == ("2", want)
        # steady state: resyncs later the spec was written once (generation: create, scale, our write)
        time.sleep(2)
        assert ctl.reconciler.cache.synced()
        assert e["apps"].read_namespaced_stateful_set("sc", ns).metadata.generation == 3
    finally:
        ctl.stop(10)
