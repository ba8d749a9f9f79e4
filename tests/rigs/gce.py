"""A GCE Compute API emulator (v1 REST, the shapes ``google-cloud-compute`` speaks) for the TPU
node-group controller's tests and for people trying it without a GCP project
(docs/tpu-node-groups.md).

What it serves, under ``/compute/v1/projects/<project>/``:

* ``regions/<r>/resourcePolicies`` (insert, get, list, delete);
* ``global/instanceTemplates`` and ``regions/<r>/instanceTemplates`` (insert, get, list, delete);
* ``zones/<z>/instanceGroupManagers`` (insert, get, list, delete, ``listManagedInstances``):
  a MIG creates ``targetSize`` instances from its template (BULK: all at once or none);
* ``zones/<z>/instances`` (get, list, ``setMetadata`` with the metadata fingerprint: a stale one
  is ``412 conditionNotMet``);
* ``zones/<z>/operations``, ``regions/<r>/operations``, ``global/operations`` (get, wait):
  every mutation answers with an operation that is ``DONE`` after ``op_delay_s``; the change
  is applied when it completes, and a failed one carries ``error`` and ``httpErrorStatusCode``.

Requests are checked as GCE checks them, against Google's compute v1 discovery document (the
one ``google-api-python-client`` ships): a body field the schema does not know is
``400 invalid``. Errors are GCE's JSON (``{"error": {"code", "message", "errors": [{"reason",
"domain", "message"}]}}``). Lists page with ``maxResults`` / ``pageToken``.

Faults a test switches on (:class:`Faults`, or ``POST /_emulator/faults`` with the same fields):
``unavailable`` (the next N requests answer 503), ``errors`` (the next request of a method
answers a given code), ``op_delay_s`` (slow operations), ``quota_exceeded`` (instance creation
fails with QUOTA_EXCEEDED: no VM, the error in the managed instance's ``lastAttempt``),
``bulk_unplaceable`` (a BULK MIG cannot be placed: no VM at all, ZONE_RESOURCE_POOL_EXHAUSTED),
``stuck_provisioning`` (new instances stay PROVISIONING), ``fail_ops`` (an operation accepted
now fails when it completes). ``GET /_emulator/stats`` counts requests and writes;
:attr:`Compute.on_write` runs after each write is applied and before it is answered (a test kills
the controller there: the write happened, the controller never heard of it).

An insert with a ``requestId`` GCE has seen answers the first one's operation, as GCE does; a
VM a MIG creates carries its template's labels and, in metadata ``created-by``, the MIG.

Run it standalone: ``make gce-emulator`` (``python -m tests.rigs.gce --port 8089`` from a checkout); point the controller at
it with ``--gce-endpoint http://127.0.0.1:8089``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

BASE = "https://www.googleapis.com/compute/v1/"


def discovery_document() -> dict:
    """Google's compute v1 discovery document, as google-api-python-client ships it."""
    import googleapiclient

    path = Path(googleapiclient.__file__).parent / "discovery_cache" / "documents" / "compute.v1.json"
    return json.loads(path.read_text())


class GCEError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message,
                          "errors": [{"message": self.message, "domain": "global", "reason": self.reason}]}}


class Schema:
    """Body checks against the discovery document's schemas: unknown fields are refused."""

    def __init__(self, doc: dict):
        self.schemas = doc["schemas"]

    def check(self, schema: str, value, where: str = "") -> None:
        self._check({"$ref": schema}, value, where or schema)

    def _check(self, spec: dict, value, where: str) -> None:
        if "$ref" in spec:
            spec = self.schemas[spec["$ref"]]
        t = spec.get("type")
        if t == "object" and isinstance(value, dict):
            props = spec.get("properties") or {}
            extra = spec.get("additionalProperties")
            for k, v in value.items():
                if k in props:
                    self._check(props[k], v, f"{where}.{k}")
                elif extra is not None:
                    self._check(extra, v, f"{where}.{k}")
                else:
                    raise GCEError(400, "invalid", f"Invalid JSON payload received. Unknown name \"{k}\" at '{where}': "
                                                   "Cannot find field.")
        elif t == "array" and isinstance(value, list):
            for i, v in enumerate(value):
                self._check(spec.get("items") or {}, v, f"{where}[{i}]")
        elif t == "object" or t == "array":
            raise GCEError(400, "invalid", f"Invalid value at '{where}': expected {t}")
        elif "enum" in spec and value not in spec["enum"]:
            raise GCEError(400, "invalid", f"Invalid value at '{where}' ({spec.get('type')}), \"{value}\"")


@dataclass
class Faults:
    unavailable: int = 0  # the next N requests answer 503
    errors: list = field(default_factory=list)  # [{"method": "POST", "path": "regex", "code": 403, "reason": ...}] once each
    op_delay_s: float = 0.0
    boot_s: float = 0.0  # PROVISIONING -> RUNNING after this long
    quota_exceeded: bool = False
    bulk_unplaceable: bool = False
    stuck_provisioning: bool = False
    fail_ops: list = field(default_factory=list)  # [{"type": "insert", "path": "regex", "code": 500, "reason": ...}]
    # once each: the next matching operation is accepted and fails when it completes


def fingerprint(obj) -> str:
    return base64.b64encode(hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).digest()[:8]).decode()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime())


_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class Compute:
    """The emulated project state, transport-free. Thread-safe; time advances lazily (every
    request first completes what is due)."""

    def __init__(self, clock=time.monotonic):
        self.schema = Schema(discovery_document())
        self.clock = clock
        self.lock = threading.RLock()
        self.faults = Faults()
        self.resources: dict[str, dict] = {}  # selfLink path (after BASE) -> resource
        self.ops: dict[str, dict] = {}  # op path -> {"op": dict, "due": t, "apply": fn}
        self.boots: dict[str, float] = {}  # instance path -> when RUNNING
        self.ids = itertools.count(1000)
        self.stats = {"requests": 0, "writes": 0}
        self.requests: dict[str, dict] = {}  # requestId -> the operation it made (GCE keeps them an hour)
        self.on_write = None  # callable(n, method, path) run after the n-th write is applied, before its answer

    # -- bookkeeping ---------------------------------------------------------------------------

    def advance(self) -> None:
        now = self.clock()
        for path, rec in list(self.ops.items()):
            if rec["op"]["status"] != "DONE" and now >= rec["due"]:
                self._finish(rec)
        for path, due in list(self.boots.items()):
            inst = self.resources.get(path)
            if inst is None:
                del self.boots[path]
            elif not self.faults.stuck_provisioning and now >= due:
                inst["status"] = "RUNNING"
                del self.boots[path]

    def _finish(self, rec: dict) -> None:
        op = rec["op"]
        try:
            rec["apply"]()
        except GCEError as e:
            op["error"] = {"errors": [{"code": e.reason.upper(), "message": e.message}]}
            op["httpErrorStatusCode"] = e.code
            op["httpErrorMessage"] = {400: "BAD REQUEST", 403: "FORBIDDEN", 404: "NOT FOUND", 409: "CONFLICT"}.get(
                e.code, "ERROR")
        op["status"], op["progress"], op["endTime"] = "DONE", 100, _now()

    def operation(self, scope: str, op_type: str, target: str, apply) -> dict:
        """A new operation in ``scope`` (``projects/p/zones/z`` ...) changing ``target``."""
        name = f"operation-{int(time.time() * 1000)}-{next(self.ids)}"
        path = f"{scope}/operations/{name}"
        op = {"kind": "compute#operation", "id": str(next(self.ids)), "name": name, "operationType": op_type,
              "targetLink": BASE + target, "status": "RUNNING", "progress": 0, "insertTime": _now(),
              "startTime": _now(), "selfLink": BASE + path}
        kind = scope.split("/")[2]
        if kind == "zones":
            op["zone"] = BASE + scope
        elif kind == "regions":
            op["region"] = BASE + scope
        for i, f in enumerate(self.faults.fail_ops):
            if f.get("type", op_type) == op_type and re.search(f.get("path", ""), target):
                del self.faults.fail_ops[i]
                apply = self._fail_late(apply, f)
                break
        rec = {"op": op, "due": self.clock() + self.faults.op_delay_s, "apply": apply}
        self.ops[path] = rec
        if self.faults.op_delay_s <= 0:
            self._finish(rec)
        return dict(op)

    @staticmethod
    def _fail_late(apply, fault: dict):
        def fail():
            raise GCEError(int(fault.get("code", 500)), fault.get("reason", "internalError"),
                           fault.get("message", f"emulated late failure {fault.get('code', 500)}"))
        return fail

    def get(self, path: str) -> dict:
        res = self.resources.get(path)
        if res is None:
            raise GCEError(404, "notFound", f"The resource '{path}' was not found")
        return res

    def list(self, prefix: str, query: dict, key: str = "items") -> dict:
        names = sorted(p for p in self.resources if p.rpartition("/")[0] == prefix)
        return self.page([self.resources[p] for p in names], query, key)

    @staticmethod
    def page(items: list, query: dict, key: str = "items") -> dict:
        size = int(query.get("maxResults", 500) or 500)
        start = int(query.get("pageToken") or 0)
        out = {key: items[start:start + size]} if items[start:start + size] else {}
        if start + size < len(items):
            out["nextPageToken"] = str(start + size)
        return out

    def insert(self, collection: str, scope: str, schema: str, body: dict, make) -> dict:
        self.schema.check(schema, body)
        name = body.get("name") or ""
        if not _NAME.match(name):
            raise GCEError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'. Must be a match of "
                                           "regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'")
        path = f"{collection}/{name}"
        if path in self.resources:
            raise GCEError(409, "alreadyExists", f"The resource '{path}' already exists")

        def apply():
            if path in self.resources:
                raise GCEError(409, "alreadyExists", f"The resource '{path}' already exists")
            res = dict(body, kind=f"compute#{schema[0].lower()}{schema[1:]}", id=str(next(self.ids)),
                       creationTimestamp=_now(), selfLink=BASE + path)
            make(res)
            self.resources[path] = res

        return self.operation(scope, "insert", path, apply)

    def delete(self, scope: str, path: str, check=lambda: None) -> dict:
        self.get(path)

        def apply():
            check()
            if self.resources.pop(path, None) is None:
                raise GCEError(404, "notFound", f"The resource '{path}' was not found")
        return self.operation(scope, "delete", path, apply)

    # -- managed instance groups ---------------------------------------------------------------

    def _template(self, url: str) -> dict:
        path = url.removeprefix(BASE)
        res = self.resources.get(path)
        if res is None:
            raise GCEError(400, "invalid", f"Invalid value for field 'resource.instanceTemplate': '{url}'. "
                                           "The referenced instanceTemplate resource cannot be found.")
        return res

    def _mig_made(self, zone_scope: str, mig: dict) -> None:
        self._template(mig["instanceTemplate"])
        for url in ((mig.get("resourcePolicies") or {}).get("workloadPolicy"),):
            if url and url.removeprefix(BASE) not in self.resources:
                raise GCEError(400, "invalid", f"Invalid value for field 'resource.resourcePolicies.workloadPolicy': "
                                               f"'{url}'. The referenced resource policy cannot be found.")
        mig.setdefault("baseInstanceName", mig["name"])
        mig["zone"] = BASE + zone_scope
        mig["fingerprint"] = fingerprint(mig["name"])
        mig["managed"] = []  # [{"name", "errors"}] (emulator-private, hidden from answers)
        self._create_instances(zone_scope, mig)

    def _create_instances(self, zone_scope: str, mig: dict) -> None:
        want = int(mig.get("targetSize") or 0)
        bulk = (mig.get("targetSizePolicy") or {}).get("mode") == "BULK"
        tmpl = self._template(mig["instanceTemplate"])
        props = tmpl.get("properties") or {}
        while len(mig["managed"]) < want:
            suffix = hashlib.sha256(f"{mig['name']}{next(self.ids)}".encode()).hexdigest()[:4]
            name = f"{mig['baseInstanceName']}-{suffix}"
            mig["managed"].append({"name": name, "errors": []})
        for m in mig["managed"]:
            path = f"{zone_scope}/instances/{m['name']}"
            if path in self.resources:
                continue
            if bulk and self.faults.bulk_unplaceable:
                m["errors"] = [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message":
                                f"The zone '{zone_scope}' does not have enough resources available to fulfill the "
                                "request. BULK: no instance of the group was created."}]
                continue
            if self.faults.quota_exceeded:
                m["errors"] = [{"code": "QUOTA_EXCEEDED", "message": "Quota 'TPU_V6E_CHIPS' exceeded. Limit: 0.0 in "
                                "region."}]
                continue
            m["errors"] = []
            items = [dict(i) for i in ((props.get("metadata") or {}).get("items") or [])
                     if i.get("key") != "created-by"]
            # GCE writes the MIG that made a VM into its metadata, under created-by
            items.append({"key": "created-by", "value": f"{zone_scope}/instanceGroupManagers/{mig['name']}"})
            inst = {"kind": "compute#instance", "id": str(next(self.ids)), "name": m["name"],
                    "creationTimestamp": _now(), "zone": BASE + zone_scope, "status": "PROVISIONING",
                    "machineType": f"{BASE}{zone_scope}/machineTypes/{props.get('machineType', '')}",
                    "metadata": {"kind": "compute#metadata", "items": items, "fingerprint": fingerprint(items)},
                    "labels": dict(props.get("labels") or {}),
                    "scheduling": props.get("scheduling") or {}, "selfLink": BASE + path}
            self.resources[path] = inst
            self.boots[path] = self.clock() + self.faults.boot_s

    def retry_creation(self) -> None:
        """GCE retries failed creations; the emulator does when asked (after a fault is cleared)."""
        with self.lock:
            for path, res in list(self.resources.items()):
                if res.get("kind") == "compute#instanceGroupManager":
                    self._create_instances(path.rsplit("/instanceGroupManagers/", 1)[0], res)

    def managed_instances(self, zone_scope: str, mig: dict) -> list[dict]:
        out = []
        for m in mig["managed"]:
            path = f"{zone_scope}/instances/{m['name']}"
            inst = self.resources.get(path)
            entry = {"instance": BASE + path, "name": m["name"], "id": inst["id"] if inst else "0"}
            if inst:
                entry["instanceStatus"] = inst["status"]
                entry["currentAction"] = "NONE" if inst["status"] == "RUNNING" else "CREATING"
            else:
                entry["currentAction"] = "CREATING"
            if m["errors"]:
                entry["lastAttempt"] = {"errors": {"errors": m["errors"]}}
            out.append(entry)
        return out

    def public(self, res: dict) -> dict:
        if res.get("kind") != "compute#instanceGroupManager":
            return res
        out = {k: v for k, v in res.items() if k != "managed"}
        zone_scope = res["selfLink"].removeprefix(BASE).rsplit("/instanceGroupManagers/", 1)[0]
        stable = all(m.get("currentAction") == "NONE" for m in self.managed_instances(zone_scope, res))
        out["status"] = {"isStable": stable}
        out["currentActions"] = {"creating": sum(1 for m in self.managed_instances(zone_scope, res)
                                                 if m["currentAction"] == "CREATING")}
        return out

    def _delete_mig_instances(self, zone_scope: str, mig: dict) -> None:
        for m in mig["managed"]:
            self.resources.pop(f"{zone_scope}/instances/{m['name']}", None)

    # -- the REST surface ----------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        with self.lock:
            self.stats["requests"] += 1
            if method in ("POST", "DELETE", "PUT", "PATCH") and not path.endswith(("/listManagedInstances", "/wait")):
                self.stats["writes"] += 1
            self.advance()
            if self.faults.unavailable > 0:
                self.faults.unavailable -= 1
                raise GCEError(503, "backendError", "The service is currently unavailable.")
            for i, err in enumerate(self.faults.errors):
                if err.get("method", method) == method and re.search(err.get("path", ""), path):
                    del self.faults.errors[i]
                    raise GCEError(int(err["code"]), err.get("reason", "forbidden"),
                                   err.get("message", f"emulated error {err['code']}"))
            rid = query.get("requestId")
            if rid and method == "POST" and rid in self.requests:  # a retried request: its first operation
                return 200, dict(self.requests[rid])
            code, out = self._route(method, path, query, body)
            if rid and method == "POST" and out.get("kind") == "compute#operation":
                self.requests[rid] = self.ops[out["selfLink"].removeprefix(BASE)]["op"]
            if self.on_write is not None and method in ("POST", "DELETE") and \
                    not path.endswith(("/listManagedInstances", "/wait")):
                self.on_write(self.stats["writes"], method, path)
            return code, out

    def _route(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        m = re.fullmatch(r"/compute/v1/(projects/[^/]+)(?:/(global|regions/[^/]+|zones/[^/]+))/([A-Za-z]+)"
                         r"(?:/([^/]+))?(?:/([A-Za-z]+))?", path)
        if not m:
            raise GCEError(404, "notFound", f"The requested URL {path} was not found on this server.")
        project, where, coll, name, verb = m.groups()
        scope = f"{project}/{where}"
        cpath = f"{scope}/{coll}"
        rpath = f"{cpath}/{name}" if name else None
        loc = where.split("/")[0]
        if coll == "operations" and name:
            rec = self.ops.get(rpath)
            if rec is None:
                raise GCEError(404, "notFound", f"The resource '{rpath}' was not found")
            if verb == "wait" and rec["op"]["status"] != "DONE":
                due = rec["due"]
                self.lock.release()
                try:
                    time.sleep(max(0.0, min(due - self.clock(), 30.0)))
                finally:
                    self.lock.acquire()
                self.advance()
            return 200, dict(rec["op"])
        kinds = {("regions", "resourcePolicies"): "ResourcePolicy", ("global", "instanceTemplates"): "InstanceTemplate",
                 ("regions", "instanceTemplates"): "InstanceTemplate",
                 ("zones", "instanceGroupManagers"): "InstanceGroupManager", ("zones", "instances"): "Instance"}
        schema = kinds.get((loc, coll))
        if schema is None:
            raise GCEError(404, "notFound", f"The requested URL {path} was not found on this server.")
        if name is None:
            if method == "GET":
                return 200, dict(self.list(cpath, query), kind=f"compute#{coll[:-1]}List", selfLink=BASE + cpath)
            if method == "POST" and schema != "Instance":
                make = (lambda res: self._mig_made(scope, res)) if schema == "InstanceGroupManager" else (
                    lambda res: res.update(region=BASE + scope) if loc == "regions" else None)
                return 200, self.insert(cpath, scope, schema, body or {}, make)
            raise GCEError(405, "methodNotAllowed", f"{method} is not allowed on {path}")
        if verb is None:
            if method == "GET":
                return 200, self.public(self.get(rpath))
            if method == "DELETE" and schema != "Instance":
                res = self.get(rpath)
                if schema == "InstanceGroupManager":
                    def gone():
                        self._delete_mig_instances(scope, res)
                    return 200, self.delete(scope, rpath, gone)
                return 200, self.delete(scope, rpath, lambda: self._in_use(rpath))
            raise GCEError(405, "methodNotAllowed", f"{method} is not allowed on {path}")
        if schema == "InstanceGroupManager" and verb == "listManagedInstances" and method == "POST":
            return 200, self.page(self.managed_instances(scope, self.get(rpath)), query, "managedInstances")
        if schema == "Instance" and verb == "setMetadata" and method == "POST":
            self.schema.check("Metadata", body or {})
            inst = self.get(rpath)
            if (body or {}).get("fingerprint") != inst["metadata"]["fingerprint"]:
                raise GCEError(412, "conditionNotMet", "Supplied fingerprint does not match current metadata "
                                                       "fingerprint.")
            items = [{"key": i["key"], "value": i.get("value", "")} for i in (body.get("items") or [])]

            def apply():
                inst["metadata"] = {"kind": "compute#metadata", "items": items,
                                    "fingerprint": fingerprint([items, next(self.ids)])}
            return 200, self.operation(scope, "setMetadata", rpath, apply)
        raise GCEError(404, "notFound", f"The requested URL {path} was not found on this server.")

    def _in_use(self, path: str) -> None:
        url = BASE + path
        for other, res in self.resources.items():
            if res.get("kind") == "compute#instanceGroupManager" and url in (
                    res.get("instanceTemplate"), (res.get("resourcePolicies") or {}).get("workloadPolicy")):
                raise GCEError(400, "resourceInUseByAnotherResource",
                               f"The {path.split('/')[-2][:-1]} resource '{path}' is already being used by '{other}'")

    # -- convenience for tests -----------------------------------------------------------------

    def instances(self, project: str | None = None) -> list[dict]:
        with self.lock:
            self.advance()
            return [dict(r) for p, r in self.resources.items()
                    if r.get("kind") == "compute#instance" and (project is None or p.startswith(f"projects/{project}/"))]

    def set_faults(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                if not hasattr(self.faults, k):
                    raise ValueError(f"no fault {k!r}; faults: {sorted(asdict(Faults()))}")
                setattr(self.faults, k, v)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    compute: Compute

    def log_message(self, fmt, *args):  # quiet
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client is gone (a test killed it)
            self.close_connection = True

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._answer(400, GCEError(400, "parseError", "Parse Error").body())
        if url.path == "/_emulator/faults" and method == "POST":
            try:
                self.compute.set_faults(**(body or {}))
            except (TypeError, ValueError) as e:
                return self._answer(400, GCEError(400, "invalid", str(e)).body())
            return self._answer(200, asdict(self.compute.faults))
        if url.path == "/_emulator/stats":
            return self._answer(200, dict(self.compute.stats))
        try:
            code, out = self.compute.handle(method, url.path, query, body)
        except GCEError as e:
            code, out = e.code, e.body()
        self._answer(code, out)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_DELETE(self):
        self._serve("DELETE")


class Server:
    """The emulator on ``host:port`` (0: a free port) in a thread; ``endpoint`` is what the
    controller's ``--gce-endpoint`` takes."""

    def __init__(self, compute: Compute | None = None, host: str = "127.0.0.1", port: int = 0):
        self.compute = compute or Compute()
        handler = type("Handler", (_Handler,), {"compute": self.compute})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gce-emulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.rigs.gce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8089)
    p.add_argument("--boot-seconds", type=float, default=5.0, help="PROVISIONING -> RUNNING after this long")
    p.add_argument("--op-delay", type=float, default=1.0, help="operations are DONE after this long")
    args = p.parse_args(argv)
    srv = Server(host=args.host, port=args.port)
    srv.compute.set_faults(boot_s=args.boot_seconds, op_delay_s=args.op_delay)
    print(f"GCE emulator on {srv.endpoint}", flush=True)
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
