"""A small in-memory Compute Engine REST API on loopback, for the real ``google-cloud-compute`` client.

It implements exactly what :class:`infra.gcp.GceFleet` calls, over ``google-cloud-compute``'s REST
transport (``InstancesClient(transport="rest", client_options={"api_endpoint": server.url})``):

- ``GET    /compute/v1/projects/{p}/zones/{z}/instances[?filter=...]``  (``instances.list``)
- ``POST   /compute/v1/projects/{p}/zones/{z}/instances[?requestId=...]``  (``instances.insert``)
- ``DELETE /compute/v1/projects/{p}/zones/{z}/instances/{name}``  (``instances.delete``)
- ``POST   /compute/v1/projects/{p}/zones/{z}/instances/{name}/setMetadata``  (``instances.setMetadata``)
- ``GET    /compute/v1/projects/{p}/zones/{z}/machineTypes/{type}``  (``machineTypes.get``: ``machine_types``
  says which zones offer which types, with their GPUs)
- ``GET    /compute/v1/projects/{p}/global/images[/family]/{name}``  (``images.get``, ``images.getFromFamily``:
  the names in ``images``)

Behaviour, kept honest where GceFleet depends on it:

- Every operation is answered already ``DONE`` (``kind: compute#operation``), so the client's
  ``ExtendedOperation.result()`` never polls (its poller would use the library's own
  ZoneOperationsClient on the default endpoint, not this server); ``GET .../operations/{op}`` is
  served anyway for callers that poll by hand.
- ``requestId`` dedup on insert: the same request id answers the same operation (including a failed
  one) and creates nothing.
- An instance name already in the zone is ``409 alreadyExists``; an unknown zone is ``400``.
- ``filter``: ``labels.<k> = "<v>"`` clauses, optionally parenthesised and joined with ``AND``.
- ``setMetadata`` replaces the items and needs the current ``fingerprint`` (else ``412
  conditionNotMet``), as GCE does; each change gets a new fingerprint.
- A deleted instance disappears from lists at once; with ``delete_lingers = True`` it stays listed
  ``STOPPING`` (as GCE shows it while deleting) until :meth:`finish_deletes`.
- New instances start ``RUNNING`` (``start_status = "PROVISIONING"`` to start them provisioning);
  :meth:`set_status` flips one (``TERMINATED`` to simulate a preemption).
- :meth:`fail_next_insert` makes the next insert fail: ``http=True`` answers an HTTP error body
  ``{"error": {"code", "message", "errors": [{"reason", "message"}]}}``; otherwise (what GCE does
  for ``ZONE_RESOURCE_POOL_EXHAUSTED``) a DONE operation carrying ``error.errors`` and
  ``httpErrorStatusCode``/``httpErrorMessage``, and no instance.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.fakes.http import JsonHandler

PREFIX = "/compute/v1/projects/"
_PATH = re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)/"
                   r"(?P<coll>instances|operations|machineTypes)(?:/(?P<name>[^/]+))?(?:/(?P<verb>[A-Za-z]+))?$")
_GLOBAL = re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/global/images/(?P<family>family/)?(?P<name>[^/]+)$")
_CLAUSE = re.compile(r'labels\.([a-z0-9_]+)\s*=\s*"([^"]*)"')


def _fingerprint(items: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


class GceError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class FakeGceServer:
    def __init__(self, zones: tuple[str, ...] = ("us-central1-a", "us-central1-b", "europe-west4-a")) -> None:
        self.zones = set(zones)
        self.start_status = "RUNNING"
        self.delete_lingers = False
        self.instances: dict[tuple[str, str, str], dict[str, Any]] = {}  # (project, zone, name) -> instance
        self.operations: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.by_request_id: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) as received
        #: zone -> machine type -> (GPU type, GPUs) offered there (None: every type, without GPUs, in every zone)
        self.machine_types: dict[str, dict[str, tuple[str, int]]] | None = None
        #: "project/name" or "project/family/name" of the images that exist (None: every image)
        self.images: set[str] | None = None
        self._fail_next: dict[str, Any] | None = None
        self._ids = itertools.count(1000)
        self._lock = threading.Lock()
        self._url = ""
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- test controls ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    def fail_next_insert(self, reason: str = "ZONE_RESOURCE_POOL_EXHAUSTED",
                         message: str = "The zone does not have enough resources available to fulfill the "
                                        "request.", *, code: int = 503, http: bool = False) -> None:
        self._fail_next = {"reason": reason, "message": message, "code": code, "http": http}

    def set_status(self, name: str, status: str) -> None:
        with self._lock:
            [inst] = [i for (_, _, n), i in self.instances.items() if n == name]
            inst["status"] = status

    def finish_deletes(self) -> None:
        """Drop every instance left STOPPING by a delete while ``delete_lingers`` was on."""
        with self._lock:
            for k in [k for k, i in self.instances.items() if i["status"] == "STOPPING"]:
                del self.instances[k]

    def all_instances(self) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(json.dumps(i)) for i in self.instances.values()]

    # ---- server -----------------------------------------------------------------------------------
    def start(self) -> FakeGceServer:
        server = self

        class Handler(JsonHandler):
            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                server.requests.append((method, parts.path))
                try:
                    status, obj = server.dispatch(method, unquote(parts.path), query, body)
                except GceError as e:
                    status, obj = e.code, {"error": {"code": e.code, "message": e.message, "errors": [
                        {"message": e.message, "domain": "global", "reason": e.reason}]}}
                self._send(status, obj)

            def do_GET(self) -> None:  # noqa: N802
                self._handle("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._handle("POST")

            def do_DELETE(self) -> None:  # noqa: N802
                self._handle("DELETE")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeGceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- API --------------------------------------------------------------------------------------
    def _machine_type(self, project: str, zone: str, name: str) -> tuple[int, dict[str, Any]]:
        offered = None if self.machine_types is None else self.machine_types.get(zone, {})
        if offered is not None and name not in offered:
            raise GceError(404, "notFound", f"The resource 'projects/{project}/zones/{zone}/machineTypes/{name}' "
                                            "was not found")
        mt: dict[str, Any] = {"kind": "compute#machineType", "name": name, "zone": zone, "guestCpus": 12}
        if offered is not None:
            gpu, count = offered[name]
            mt["accelerators"] = [{"guestAcceleratorType": gpu, "guestAcceleratorCount": count}]
        return 200, mt

    def _image(self, project: str, name: str, family: bool) -> tuple[int, dict[str, Any]]:
        key = f"{project}/{'family/' if family else ''}{name}"
        if self.images is not None and key not in self.images:
            what = "family" if family else "image"
            raise GceError(404, "notFound", f"The resource 'projects/{project}/global/images/"
                                            f"{'family/' if family else ''}{name}' was not found ({what})")
        return 200, {"kind": "compute#image", "name": f"{name}-v20261101" if family else name, "status": "READY",
                     "family": name if family else ""}

    def dispatch(self, method: str, path: str, query: dict[str, str],
                 body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if g := _GLOBAL.match(path):
            return self._image(g["project"], g["name"], bool(g["family"]))
        m = _PATH.match(path)
        if m is None:
            raise GceError(404, "notFound", f"The requested URL {path} was not found on this server.")
        project, zone, coll, name, verb = m["project"], m["zone"], m["coll"], m["name"], m["verb"]
        if zone not in self.zones:
            raise GceError(400, "invalid", f"Invalid value for field 'zone': '{zone}'. Unknown zone.")
        with self._lock:
            if coll == "operations" and name and method in ("GET", "POST") and verb in (None, "wait"):
                op = self.operations.get((project, zone, name))
                if op is None:
                    raise GceError(404, "notFound", f"The resource 'operations/{name}' was not found")
                return 200, op
            if coll == "machineTypes" and name and method == "GET":
                return self._machine_type(project, zone, name)
            if coll != "instances":
                raise GceError(404, "notFound", f"no route for {method} {path}")
            if name is None and method == "GET":
                return 200, self._list(project, zone, query.get("filter", ""))
            if name is None and method == "POST":
                return 200, self._insert(project, zone, body, query.get("requestId"))
            inst = self.instances.get((project, zone, name or ""))
            if inst is None:
                raise GceError(404, "notFound", f"The resource 'projects/{project}/zones/{zone}/instances/"
                                                f"{name}' was not found")
            if method == "DELETE" and verb is None:
                if self.delete_lingers:
                    inst["status"] = "STOPPING"
                else:
                    del self.instances[(project, zone, inst["name"])]
                return 200, self._op(project, zone, "delete", inst)
            if method == "POST" and verb == "setMetadata":
                if body.get("fingerprint") != inst["metadata"]["fingerprint"]:
                    raise GceError(412, "conditionNotMet", "Supplied fingerprint does not match current "
                                                           "metadata fingerprint.")
                items = [{"key": i["key"], "value": i.get("value", "")} for i in body.get("items", [])]
                inst["metadata"] = {"kind": "compute#metadata", "items": items, "fingerprint": _fingerprint(items)}
                return 200, self._op(project, zone, "setMetadata", inst)
            raise GceError(404, "notFound", f"no route for {method} {path}")

    def _self_link(self, project: str, zone: str, rest: str) -> str:
        return f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/{rest}"

    def _op(self, project: str, zone: str, kind: str, inst: dict[str, Any] | None, target: str = "",
            error: dict[str, Any] | None = None) -> dict[str, Any]:
        op_id = str(next(self._ids))
        name = f"operation-{op_id}-{kind}"
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime())
        op: dict[str, Any] = {
            "kind": "compute#operation", "id": op_id, "name": name, "operationType": kind,
            "status": "DONE", "progress": 100, "insertTime": now, "startTime": now, "endTime": now,
            "zone": self._self_link(project, zone, "")[:-1],
            "selfLink": self._self_link(project, zone, f"operations/{name}"),
            "targetLink": inst["selfLink"] if inst else target,
        }
        if inst:
            op["targetId"] = inst["id"]
        if error:
            op["error"] = {"errors": [{"code": error["reason"], "message": error["message"]}]}
            op["httpErrorStatusCode"] = error["code"]
            op["httpErrorMessage"] = "SERVICE UNAVAILABLE" if error["code"] == 503 else "ERROR"
        self.operations[(project, zone, name)] = op
        return op

    def _list(self, project: str, zone: str, flt: str) -> dict[str, Any]:
        want = dict(_CLAUSE.findall(flt))
        rest = _CLAUSE.sub("", flt).replace("AND", "").replace("(", "").replace(")", "").strip()
        if rest:
            raise GceError(400, "invalid", f"Invalid list filter expression '{flt}'.")
        items = [i for (p, z, _), i in sorted(self.instances.items())
                 if p == project and z == zone and all(i.get("labels", {}).get(k) == v for k, v in want.items())]
        return {"kind": "compute#instanceList", "id": f"projects/{project}/zones/{zone}/instances",
                "items": [json.loads(json.dumps(i)) for i in items],
                "selfLink": self._self_link(project, zone, "instances")}

    def _insert(self, project: str, zone: str, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        if request_id and request_id in self.by_request_id:
            return self.by_request_id[request_id]
        name = body.get("name", "")
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
            raise GceError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'.")
        for k, v in body.get("labels", {}).items():
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", k) or not re.fullmatch(r"[a-z0-9_-]{0,63}", v):
                raise GceError(400, "invalid", f"Invalid value for field 'resource.labels': '{k}={v}'.")
        if (project, zone, name) in self.instances:
            raise GceError(409, "alreadyExists", f"The resource 'projects/{project}/zones/{zone}/instances/"
                                                 f"{name}' already exists")
        if (fail := self._fail_next) is not None:
            self._fail_next = None
            if fail["http"]:
                raise GceError(fail["code"], fail["reason"], fail["message"])
            op = self._op(project, zone, "insert", None, self._self_link(project, zone, f"instances/{name}"), fail)
        else:
            iid = str(next(self._ids)) + "0" * 6
            items = [{"key": i["key"], "value": i.get("value", "")} for i in body.get("metadata", {}).get("items", [])]
            inst = {
                **body, "kind": "compute#instance", "id": iid, "name": name, "status": self.start_status,
                "zone": self._self_link(project, zone, "")[:-1],
                "selfLink": self._self_link(project, zone, f"instances/{name}"),
                "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime()),
                "labels": dict(body.get("labels", {})),
                "metadata": {"kind": "compute#metadata", "items": items, "fingerprint": _fingerprint(items)},
                "networkInterfaces": [{**(body.get("networkInterfaces") or [{}])[0], "name": "nic0",
                                       "networkIP": f"10.128.{int(iid[:-6]) // 250 % 250}.{int(iid[:-6]) % 250 + 2}"}],
                "scheduling": {"provisioningModel": "STANDARD", "automaticRestart": True,
                               "onHostMaintenance": "TERMINATE", **body.get("scheduling", {})},
            }
            self.instances[(project, zone, name)] = inst
            op = self._op(project, zone, "insert", inst)
        if request_id:
            self.by_request_id[request_id] = op
        return op
