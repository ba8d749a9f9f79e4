"""The TPU worker environment of a slice, as JSON Patches (docs/tpu-env.md). Pure: an object in,
patch operations out; no I/O, no API reads.

Two levels, so that no admission needs a GET: what every worker shares goes into the workload's
pod template (:func:`statefulset_patch`, :func:`job_patch`), with :data:`STATE_ANNOTATION`
recording what we set and what the pod level needs; per-pod values come from :func:`pod_patch`,
only for pods whose template carries that annotation.

Invariants: a variable we did not set is never changed; applying a patch and computing again
gives no patch. An object that is not the kind it claims raises :class:`Refused` with the field.

Others who provide for a workload are left to it (:func:`left_to_others`): a workload or pod
of LeaderWorkerSet or KubeRay (each has its own TPU webhook that sets these variables), one whose
TPU containers already set a worker variable we did not set, and - where the cluster's own
admission does it (GKE, ``platform_jobs``) - a Job of GKE's rule.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from accelnode.decode import LABEL, decode

INJECT_LABEL = "gke-tpu-env-injector.aaronbatilo.dev/inject"  # the upstream injector's opt-in label
INJECT_VALUE = "enabled"
STATE_ANNOTATION = "tpu-env.accelnode.io/injected"
TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
TPU7X_PREFIX = "tpu7x"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
STS_POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_RJOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOBSET_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"

# Labels of the pods (and, for LeaderWorkerSet, the StatefulSets) of projects whose own TPU
# webhooks set TPU_WORKER_ID/TPU_WORKER_HOSTNAMES: LeaderWorkerSet's (pkg/utils/accelerators/tpu.go;
# lws.sigs.k8s.io "Labels, Annotations and Environment Variables") and KubeRay's TPU webhook.
OTHERS_LABELS = ("leaderworkerset.sigs.k8s.io/name", "ray.io/cluster")
# A worker variable already set in a TPU container by someone else means the slice is theirs.
WORKER_VARS = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES")

PROCESS_PORT = 8476  # TPU_PROCESS_PORT of the first TPU process in a pod (GKE's TPU7x default)
MEGASCALE_PORT = 8080  # libtpu's multislice (DCN) port
MAX_WORKERS = 4096  # hosts in one slice: the largest TPU slices have about 2,300
MAX_INDEX = 1 << 20  # ordinals and indexes beyond this are not a TPU slice


class Refused(ValueError):
    """The object cannot be admitted as written (the message names the field)."""


# -- reading objects -------------------------------------------------------------------------------


def _get(obj, *keys, kind=dict, default=None, where=""):
    """``obj[k1][k2]...`` when each step is a dict and the value is of ``kind``; ``default`` when
    a key is absent or null; :class:`Refused` when something on the way has the wrong type."""
    path = where
    for k in keys:
        if not isinstance(obj, dict):
            raise Refused(f"{path or 'the object'} is not an object")
        path = f"{path}.{k}" if path else k
        obj = obj.get(k)
        if obj is None:
            return default
    if kind is int and isinstance(obj, bool) or not isinstance(obj, kind):
        raise Refused(f"{path} is not {'a ' + kind.__name__ if kind is not dict else 'an object'}")
    return obj


def _int(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, str) and value.isdigit() and len(value) < 10:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Refused(f"{what} must be an integer from {lo} to {hi}, got {value!r}")
    return value


def requests_tpu(container) -> bool:
    """The container asks for ``google.com/tpu`` in its limits or requests (a non-zero amount)."""
    res = container.get("resources") if isinstance(container, dict) else None
    if not isinstance(res, dict):
        return False
    for part in ("limits", "requests"):
        amounts = res.get(part)
        if isinstance(amounts, dict) and str(amounts.get(TPU_RESOURCE, "0")).strip() not in ("", "0"):
            return True
    return False


def containers_of(pod_spec: dict, where: str) -> list[dict]:
    containers = _get(pod_spec, "containers", kind=list, default=[], where=where)
    for i, c in enumerate(containers):
        if not isinstance(c, dict):
            raise Refused(f"{where}.containers[{i}] is not an object")
        if c.get("env") is not None and not isinstance(c["env"], list):
            raise Refused(f"{where}.containers[{i}].env is not a list")
    return containers


def targets(containers: list[dict]) -> list[int]:
    """Indexes of the containers that get the variables: those requesting TPUs, else all."""
    tpu = [i for i, c in enumerate(containers) if requests_tpu(c)]
    return tpu or list(range(len(containers)))


def is_tpu7x(pod_spec: dict) -> bool:
    sel = pod_spec.get("nodeSelector")
    value = sel.get(ACCELERATOR_SELECTOR) if isinstance(sel, dict) else None
    return isinstance(value, str) and value.startswith(TPU7X_PREFIX)


def left_to_others(*metas, containers: list[dict] = (), recorded: dict[str, str] | None = None) -> bool:
    """Whether another project provides the TPU worker variables: a label of
    :data:`OTHERS_LABELS` on any of ``metas`` (object metadata), or an entry of
    :data:`WORKER_VARS` in one of ``containers`` that is not ours (ours: recorded with the digest
    of its value, as :func:`env_ops` tells them)."""
    for meta in metas:
        labels = meta.get("labels") if isinstance(meta, dict) else None
        if isinstance(labels, dict) and any(k in labels for k in OTHERS_LABELS):
            return True
    recorded = recorded or {}
    for c in containers:
        for e in c.get("env") or []:
            if not isinstance(e, dict) or e.get("name") not in WORKER_VARS:
                continue
            ours = (e["name"] in recorded and "valueFrom" not in e and isinstance(e.get("value"), str)
                    and digest(e["value"]) == recorded[e["name"]])
            if not ours:
                return True
    return False


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def pointer(*parts) -> str:
    """A JSON Pointer (RFC 6901) from path segments."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


# -- the slice ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slice:
    """One TPU slice as its workers see it. ``hosts`` are the workers' DNS names ordered by
    worker index; ``per_pod`` TPU processes run in each pod, on ports ``port + i`` (``port`` is
    None when the generation runs one process per host and has no process addresses)."""

    kind: str  # StatefulSet | Job: where the pod level finds the pod's index
    hosts: tuple[str, ...]
    start: int = 0  # first ordinal (StatefulSet spec.ordinals.start)
    per_pod: int = 1
    port: int | None = None
    num_slices: int = 1
    slice_id: int = 0
    coordinator: str = ""  # slice 0's worker 0

    def env(self) -> dict[str, str]:
        out = {"TPU_WORKER_HOSTNAMES": ",".join(self.hosts)}
        if self.port is not None:
            out["TPU_PROCESS_ADDRESSES"] = ",".join(f"{h}:{self.port + i}" for h in self.hosts
                                                    for i in range(self.per_pod))
        out.update({"MEGASCALE_COORDINATOR_ADDRESS": self.coordinator or self.hosts[0],
                    "MEGASCALE_NUM_SLICES": str(self.num_slices), "MEGASCALE_SLICE_ID": str(self.slice_id),
                    "MEGASCALE_PORT": str(MEGASCALE_PORT)})
        return out

    def state(self, owned: dict[str, str]) -> dict:
        return {"kind": self.kind, "start": self.start, "workers": len(self.hosts), "perPod": self.per_pod,
                "port": self.port, "vars": owned}


def _processes(pod_spec: dict, containers: list[dict]) -> tuple[int, int | None]:
    """(TPU processes per pod, base port): on TPU7x one per TPU container from 8476."""
    n = sum(1 for c in containers if requests_tpu(c))
    if is_tpu7x(pod_spec) and n:
        return n, PROCESS_PORT
    return 1, None


# -- patches -----------------------------------------------------------------------------------------


def env_ops(container: dict, path: str, want: dict[str, str], recorded: dict[str, str]) -> tuple[list, set]:
    """Operations that bring ``want`` into the container's env, and the names we own after them.

    An entry is ours when ``recorded`` has its name with the digest of its value: ours are kept
    current, de-duplicated, and removed when not wanted. Any other entry of a wanted name is the
    user's: it stays, and an entry of ours beside it goes (the user's value rules)."""
    env = container.get("env")
    entries = env if isinstance(env, list) else []
    by_name: dict[str, list[int]] = {}
    for j, e in enumerate(entries):
        if isinstance(e, dict) and isinstance(e.get("name"), str):
            by_name.setdefault(e["name"], []).append(j)
    replace, remove, add, owned = [], [], [], set()
    for name in [*want, *sorted(set(recorded) - set(want))]:  # in the order wanted: TPU_WORKER_HOSTNAMES first
        idxs = by_name.get(name, [])
        ours = [j for j in idxs if name in recorded and "valueFrom" not in entries[j]
                and isinstance(entries[j].get("value"), str) and digest(entries[j]["value"]) == recorded[name]]
        users = [j for j in idxs if j not in ours]
        if name not in want or users:
            remove += ours
            continue
        owned.add(name)
        if not ours:
            add.append({"name": name, "value": want[name]})
            continue
        if entries[ours[0]]["value"] != want[name]:
            replace.append({"op": "replace", "path": f"{path}/env/{ours[0]}/value", "value": want[name]})
        remove += ours[1:]
    ops = replace + [{"op": "remove", "path": f"{path}/env/{j}"} for j in sorted(remove, reverse=True)]
    if add and not isinstance(env, list):
        ops.append({"op": "add", "path": f"{path}/env", "value": add})
    else:
        ops += [{"op": "add", "path": f"{path}/env/-", "value": e} for e in add]
    return ops, owned


def recorded_state(meta) -> dict | None:
    """The state annotation of a template's (or pod's) metadata, or None when absent or not ours."""
    ann = meta.get("annotations") if isinstance(meta, dict) else None
    raw = ann.get(STATE_ANNOTATION) if isinstance(ann, dict) else None
    if not isinstance(raw, str) or len(raw) > 64 * 1024:
        return None
    try:
        state = decode(raw, LABEL, STATE_ANNOTATION)
    except ValueError:
        return None
    if not isinstance(state, dict) or not isinstance(state.get("vars"), dict):
        return None
    return state


def template_patch(template: dict, base: str, sl: Slice | None) -> list:
    """Operations on a pod template at ``base`` (e.g. ``/spec/template``) that make its env and
    state annotation those of ``sl``; ``sl`` None removes what we set before."""
    meta = _get(template, "metadata", default={}, where="spec.template")
    spec = _get(template, "spec", default={}, where="spec.template")
    containers = containers_of(spec, "spec.template.spec")
    old = recorded_state(meta)
    recorded = {k: v for k, v in (old or {}).get("vars", {}).items() if isinstance(v, str)}
    chosen = set(targets(containers))
    if sl is not None and left_to_others(meta, containers=[containers[i] for i in chosen], recorded=recorded):
        sl = None  # theirs: what we set before goes, theirs stays
    want = sl.env() if sl is not None else {}
    ops, owned = [], set()
    for i, c in enumerate(containers):
        # the record names values, not containers: a container we do not give the env may hold the
        # user's entry of the same name and value, which is never ours to remove
        c_ops, c_owned = env_ops(c, f"{base}/spec/containers/{i}", want if i in chosen else {},
                                 recorded if i in chosen else {})
        ops += c_ops
        owned |= c_owned
    new = sl.state({k: digest(want[k]) for k in sorted(owned)}) if sl is not None else None
    ann = meta.get("annotations")
    if new == old:
        pass
    elif new is None:
        if isinstance(ann, dict) and STATE_ANNOTATION in ann:
            ops.append({"op": "remove", "path": f"{base}/metadata/annotations{pointer(STATE_ANNOTATION)}"})
    else:
        value = json.dumps(new, sort_keys=True, separators=(",", ":"))
        if "metadata" not in template or template["metadata"] is None:
            ops.append({"op": "add", "path": f"{base}/metadata", "value": {"annotations": {STATE_ANNOTATION: value}}})
        elif not isinstance(ann, dict):
            ops.append({"op": "add", "path": f"{base}/metadata/annotations", "value": {STATE_ANNOTATION: value}})
        else:
            ops.append({"op": "add", "path": f"{base}/metadata/annotations{pointer(STATE_ANNOTATION)}", "value": value})
    return ops


# -- workloads ---------------------------------------------------------------------------------------


def statefulset_slice(sts: dict) -> tuple[Slice | None, list[str]]:
    """The slice an opted-in StatefulSet describes (None when it is not opted in, or has no
    replicas), and warnings for its author."""
    labels = _get(sts, "metadata", "labels", default={})
    if labels.get(INJECT_LABEL) != INJECT_VALUE or left_to_others(_get(sts, "metadata", default={})):
        return None, []
    name = _get(sts, "metadata", "name", kind=str, default="")
    service = _get(sts, "spec", "serviceName", kind=str, default="")
    if not name:
        raise Refused("metadata.name is required")
    if not service:
        raise Refused(f"a StatefulSet labelled {INJECT_LABEL}={INJECT_VALUE} needs spec.serviceName: the headless "
                      "Service that gives each TPU worker its DNS name")
    replicas = _int(_get(sts, "spec", "replicas", kind=int, default=1), "spec.replicas", 0, MAX_WORKERS)
    start = _int(_get(sts, "spec", "ordinals", "start", kind=int, default=0), "spec.ordinals.start", 0, MAX_INDEX)
    template = _get(sts, "spec", "template")
    if template is None:
        raise Refused("spec.template is required")
    warnings = []
    if (_get(template, "metadata", "labels", default={}, where="spec.template") or {}).get(INJECT_LABEL) != INJECT_VALUE:
        warnings.append(f"the pod template lacks the label {INJECT_LABEL}={INJECT_VALUE}: its pods will not get "
                        "TPU_WORKER_ID")
    if replicas == 0:
        return None, warnings
    spec = _get(template, "spec", default={}, where="spec.template")
    per_pod, port = _processes(spec, containers_of(spec, "spec.template.spec"))
    hosts = tuple(f"{name}-{start + i}.{service}" for i in range(replicas))
    return Slice("StatefulSet", hosts, start=start, per_pod=per_pod, port=port), warnings


def statefulset_patch(sts: dict) -> tuple[list, list[str]]:
    """(JSON Patch operations, warnings) for a StatefulSet being created or updated."""
    sl, warnings = statefulset_slice(sts)
    return template_patch(_get(sts, "spec", "template", default={}), "/spec/template", sl), warnings


def job_slice(job: dict, platform_jobs: bool = False) -> tuple[Slice | None, list[str]]:
    """The slice a Job describes under GKE's rule (completionMode Indexed, a pod subdomain,
    parallelism over 1, a container requesting ``google.com/tpu``) or as one slice of a JobSet
    (its ``jobset.sigs.k8s.io/*`` labels: then one host per slice is enough); None otherwise.
    ``platform_jobs``: the cluster's own admission gives the Jobs of GKE's rule their variables
    (on GKE), so those are None too; a JobSet's one-host Jobs, which that rule leaves out, are
    still ours."""
    spec = _get(job, "spec", default={})
    pod = _get(spec, "template", "spec", default={}, where="spec")
    containers = containers_of(pod, "spec.template.spec")
    labels = _get(job, "metadata", "labels", default={})
    parallelism = _int(_get(spec, "parallelism", kind=int, default=1), "spec.parallelism", 0, MAX_INDEX)
    subdomain = _get(pod, "subdomain", kind=str, default="", where="spec.template.spec")
    jobset = JOBSET_NAME in labels
    if (spec.get("completionMode") != "Indexed" or not subdomain or not any(map(requests_tpu, containers))
            or parallelism < 1 or (parallelism == 1 and not jobset) or (platform_jobs and parallelism > 1)
            or left_to_others(_get(job, "metadata", default={}))):
        return None, []
    if parallelism > MAX_WORKERS:
        raise Refused(f"spec.parallelism {parallelism} is more TPU hosts than one slice has (at most {MAX_WORKERS})")
    warnings = []
    completions = spec.get("completions")
    if completions is not None and completions != parallelism:
        warnings.append(f"spec.completions ({completions}) differs from spec.parallelism ({parallelism}): a TPU "
                        f"slice runs all its workers at once, and TPU_WORKER_HOSTNAMES names {parallelism}")
    per_pod, port = _processes(pod, containers)
    if not jobset:
        name = _get(job, "metadata", "name", kind=str, default="")
        if not name:
            raise Refused("metadata.name is required")
        hosts = tuple(f"{name}-{i}.{subdomain}" for i in range(parallelism))
        return Slice("Job", hosts, per_pod=per_pod, port=port), warnings
    js, rjob = labels.get(JOBSET_NAME), labels.get(JOBSET_RJOB)
    if not isinstance(js, str) or not js or not isinstance(rjob, str) or not rjob:
        raise Refused(f"a JobSet's Job carries non-empty labels {JOBSET_NAME} and {JOBSET_RJOB}")
    slices = _int(labels.get(JOBSET_REPLICAS), f"label {JOBSET_REPLICAS}", 1, MAX_WORKERS)
    index = _int(labels.get(JOBSET_JOB_INDEX), f"label {JOBSET_JOB_INDEX}", 0, slices - 1)
    hosts = tuple(f"{js}-{rjob}-{index}-{i}.{subdomain}" for i in range(parallelism))
    return Slice("Job", hosts, per_pod=per_pod, port=port, num_slices=slices, slice_id=index,
                 coordinator=f"{js}-{rjob}-0-0.{subdomain}"), warnings


def job_patch(job: dict, platform_jobs: bool = False) -> tuple[list, list[str]]:
    """(JSON Patch operations, warnings) for a Job being created; no operations for a Job that
    is not a TPU slice, or is one the platform provides for (:func:`job_slice`)."""
    sl, warnings = job_slice(job, platform_jobs)
    if sl is None:
        return [], warnings
    return template_patch(_get(job, "spec", "template", default={}), "/spec/template", sl), warnings


# -- pods --------------------------------------------------------------------------------------------


def pod_index(pod: dict, state: dict) -> int:
    """The pod's worker index in its slice (ordinal minus the first ordinal, or the completion
    index), checked against the number of workers its template names."""
    meta = _get(pod, "metadata", default={})
    labels = _get(meta, "labels", default={}, where="metadata")
    workers = _int(state.get("workers"), f"{STATE_ANNOTATION} workers", 1, MAX_WORKERS)
    if state.get("kind") == "StatefulSet":
        start = _int(state.get("start", 0), f"{STATE_ANNOTATION} start", 0, MAX_INDEX)
        raw = labels.get(POD_INDEX_LABEL)
        if raw is None:  # clusters before pod-index labels: the pod name's last part
            raw = str(labels.get(STS_POD_NAME_LABEL) or meta.get("name") or "").rpartition("-")[2]
        ordinal = _int(raw, f"label {POD_INDEX_LABEL}", 0, MAX_INDEX + MAX_WORKERS)
        index, what = ordinal - start, f"ordinal {ordinal} (first ordinal {start})"
    elif state.get("kind") == "Job":
        ann = _get(meta, "annotations", default={}, where="metadata")
        raw = labels.get(COMPLETION_INDEX, ann.get(COMPLETION_INDEX))
        index = _int(raw, f"{COMPLETION_INDEX}", 0, MAX_INDEX)
        what = f"completion index {index}"
    else:
        raise Refused(f"annotation {STATE_ANNOTATION} names no known workload kind")
    if not 0 <= index < workers:
        raise Refused(f"pod with {what} is outside the {workers} TPU workers its template names; the template "
                      "must be updated first (a scale through /scale: see docs/tpu-env.md)")
    return index


def pod_patch(pod: dict) -> list:
    """Operations giving each chosen container of a pod created from an annotated template its
    ``TPU_WORKER_ID`` (and ``TPU_PROCESS_PORT`` on TPU7x); none for other pods."""
    meta = _get(pod, "metadata", default={})
    state = recorded_state(meta)
    if state is None or left_to_others(meta):
        return []
    index = pod_index(pod, state)
    containers = containers_of(_get(pod, "spec", default={}), "spec")
    per_pod = _int(state.get("perPod", 1), f"{STATE_ANNOTATION} perPod", 1, 64)
    port = state.get("port")
    ops = []
    if port is None:
        for i in targets(containers):
            ops += env_ops(containers[i], f"/spec/containers/{i}", {"TPU_WORKER_ID": str(index)}, {})[0]
        return ops
    port = _int(port, f"{STATE_ANNOTATION} port", 1, 65535 - 64)
    tpu = [i for i, c in enumerate(containers) if requests_tpu(c)]
    if len(tpu) > per_pod:
        raise Refused(f"the pod has {len(tpu)} containers requesting {TPU_RESOURCE}; its template had {per_pod}")
    for n, i in enumerate(tpu):
        want = {"TPU_WORKER_ID": str(index * per_pod + n), "TPU_PROCESS_PORT": str(port + n)}
        ops += env_ops(containers[i], f"/spec/containers/{i}", want, {})[0]
    return ops


def apply_ops(obj: dict, ops: list) -> None:
    """Apply operations of the kinds this module makes (add, replace, remove) to ``obj`` in place."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if not isinstance(node, list):
            if op["op"] == "remove":
                del node[last]
            else:
                node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last)]
        elif last == "-":
            node.append(op["value"])
        elif op["op"] == "replace":
            node[int(last)] = op["value"]
        else:
            node.insert(int(last), op["value"])
