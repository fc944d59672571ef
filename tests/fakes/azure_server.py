"""A small in-memory Azure Resource Manager on loopback, for the real ``azure-mgmt-compute`` / ``azure-mgmt-network``
clients (``base_url=server.url`` and a no-op authentication policy: the bearer policy refuses plain HTTP).

It implements exactly what :class:`infra.azure.AzureFleet` calls:

- ``GET    /subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines[?$expand=instanceView]``
- ``PUT    .../virtualMachines/{name}``   (``begin_create_or_update``: create, or update an existing one)
- ``PATCH  .../virtualMachines/{name}``   (``begin_update``: the tags, replaced as a whole, as ARM does)
- ``DELETE .../virtualMachines/{name}``   (``begin_delete``)
- ``GET    .../virtualMachines/{name}``
- ``GET    .../providers/Microsoft.Network/networkInterfaces/{name}``
- ``GET    /subscriptions/{s}/providers/Microsoft.Compute/skus``   (``resource_skus.list``: :attr:`skus`)
- ``GET    .../locations/{l}/publishers/{p}/artifacttypes/vmimage/offers/{o}/skus/{k}/versions``
  (``virtual_machine_images.list``: :attr:`image_versions`)

Behaviour, kept honest where AzureFleet depends on it:

- Every long-running operation is answered already done (``provisioningState: Succeeded`` in the body, no
  ``Azure-AsyncOperation`` header), so the client's poller does not poll.
- A VM created with an inline NIC configuration gets that NIC (``{name}``, a private address from 10.3.0.0/16), listed
  in its ``networkProfile.networkInterfaces``; deleting the VM deletes the NIC (``deleteOption: Delete``).
- New VMs are ``PowerState/running`` (``start_power = "starting"`` to start them booting); :meth:`evict` deletes one
  (a spot eviction with ``evictionPolicy: Delete``). With ``delete_lingers = True`` a deleted VM stays listed
  ``Deleting`` until :meth:`finish_deletes`.
- :meth:`fail_next_create` makes the next PUT of a new VM fail with an ARM error body
  ``{"error": {"code", "message"}}`` (default ``409 OperationNotAllowed``, a quota refusal) and create nothing.
- ``customData`` is kept (base64, as sent) but, as ARM does, never returned; :meth:`custom_data` reads it.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from tests.fakes.http import JsonHandler

_PATH = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/"
                   r"(?P<prov>Microsoft\.Compute/virtualMachines|Microsoft\.Network/networkInterfaces)"
                   r"(?:/(?P<name>[^/]+))?$")


_SKUS = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/Microsoft\.Compute/skus$")
_IMAGES = re.compile(r"^/subscriptions/[^/]+/providers/Microsoft\.Compute/locations/(?P<loc>[^/]+)/publishers/"
                     r"(?P<pub>[^/]+)/artifacttypes/vmimage/offers/(?P<offer>[^/]+)/skus/(?P<sku>[^/]+)/versions$")


class FakeArmServer:
    def __init__(self) -> None:
        self.vms: dict[tuple[str, str, str], dict[str, Any]] = {}  # (sub, rg, name) -> VM as ARM returns it
        self.custom: dict[tuple[str, str, str], str] = {}
        self.nics: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.start_power = "running"
        self.delete_lingers = False
        self._fail: tuple[int, str, str] | None = None
        self._ips = (f"10.3.{i // 250}.{i % 250 + 4}" for i in itertools.count())
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        #: the resource SKUs (``GET .../providers/Microsoft.Compute/skus``), as ARM lists them
        self.skus: list[dict[str, Any]] = []
        #: "location/publisher/offer/sku" -> the image versions offered there
        self.image_versions: dict[str, list[str]] = {}

    # ---- test controls ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def fail_next_create(self, code: str = "OperationNotAllowed", message: str = "Operation could not be completed "
                         "as it results in exceeding approved standardNCADSA100v4Family Cores quota.",
                         status: int = 409) -> None:
        self._fail = (status, code, message)

    def evict(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self.vms if k[2] == name]:
                self._remove(key)

    def finish_deletes(self) -> None:
        with self._lock:
            for key in [k for k, v in self.vms.items() if v["properties"]["provisioningState"] == "Deleting"]:
                self._remove(key)

    def all_vms(self) -> list[dict[str, Any]]:
        with self._lock:
            return json.loads(json.dumps(list(self.vms.values())))

    def custom_data(self, name: str) -> str | None:
        return next((v for k, v in self.custom.items() if k[2] == name), None)

    # ---- the server -------------------------------------------------------------------------------------
    def start(self) -> FakeArmServer:
        fake = self

        class Handler(JsonHandler):
            def _handle(self, method: str) -> None:
                u = urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                fake.requests.append((method, u.path))
                status, out = fake.dispatch(method, u.path, body)
                if out is None:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._send(status, out)

            def do_GET(self) -> None:  # noqa: N802
                self._handle("GET")

            def do_PUT(self) -> None:  # noqa: N802
                self._handle("PUT")

            def do_PATCH(self) -> None:  # noqa: N802
                self._handle("PATCH")

            def do_DELETE(self) -> None:  # noqa: N802
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeArmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- ARM ---------------------------------------------------------------------------------------------
    @staticmethod
    def _error(status: int, code: str, message: str) -> tuple[int, dict[str, Any]]:
        return status, {"error": {"code": code, "message": message}}

    def dispatch(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        if method == "GET" and _SKUS.match(path):
            return 200, {"value": self.skus}
        if method == "GET" and (im := _IMAGES.match(path)):  # a bare JSON array, as ARM answers this one
            key = "/".join((im["loc"], im["pub"], im["offer"], im["sku"]))
            return 200, [{"name": v, "location": im["loc"], "id": f"{path}/{v}"}  # type: ignore[return-value]
                         for v in self.image_versions.get(key, [])]
        m = _PATH.match(path)
        if not m:
            return self._error(404, "InvalidResourceType", f"no route {method} {path}")
        sub, rg, prov, name = m["sub"], m["rg"], m["prov"], m["name"]
        with self._lock:
            if prov.endswith("networkInterfaces"):
                nic = self.nics.get((sub, rg, name or ""))
                return (200, nic) if nic and method == "GET" else self._error(404, "NotFound", f"NIC {name}")
            if name is None:
                if method != "GET":
                    return self._error(405, "MethodNotAllowed", method)
                return 200, {"value": [v for k, v in self.vms.items() if k[:2] == (sub, rg)]}
            key = (sub, rg, name)
            if method == "GET":
                return (200, self.vms[key]) if key in self.vms else self._error(404, "ResourceNotFound", name)
            if method == "PUT":
                return self._put(key, path, body)
            if method == "PATCH":
                if key not in self.vms:
                    return self._error(404, "ResourceNotFound", name)
                if "tags" in body:
                    self.vms[key]["tags"] = dict(body["tags"] or {})
                return 200, self.vms[key]
            if method == "DELETE":
                if key not in self.vms:
                    return 204, None
                if self.delete_lingers:
                    self.vms[key]["properties"]["provisioningState"] = "Deleting"
                    return 202, None
                self._remove(key)
                return 200, None
        return self._error(405, "MethodNotAllowed", method)

    def _put(self, key: tuple[str, str, str], path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sub, rg, name = key
        props = dict(body.get("properties") or {})
        if key in self.vms:  # an update (a retried create lands here): tags and nothing else of ours change
            self.vms[key]["tags"] = dict(body.get("tags") or self.vms[key]["tags"])
            return 200, self.vms[key]
        if self._fail is not None:
            (status, code, message), self._fail = self._fail, None
            return self._error(status, code, message)
        if not (props.get("hardwareProfile") or {}).get("vmSize") or not body.get("location"):
            return self._error(400, "InvalidParameter", "location and hardwareProfile.vmSize are required")
        nics = []
        for cfg in (props.get("networkProfile") or {}).get("networkInterfaceConfigurations") or []:
            nic_id = f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Network/networkInterfaces/{cfg['name']}"
            self.nics[(sub, rg, cfg["name"])] = {"id": nic_id, "name": cfg["name"], "properties": {
                "ipConfigurations": [{"name": "ipconfig1", "properties": {"privateIPAddress": next(self._ips)}}]}}
            nics.append({"id": nic_id, "properties": {"primary": True, "deleteOption": "Delete"}})
        os_profile = dict(props.get("osProfile") or {})
        if "customData" in os_profile:
            self.custom[key] = os_profile.pop("customData")
        props.update(osProfile=os_profile, provisioningState="Succeeded", vmId=f"vm-{len(self.vms)}",
                     networkProfile={**(props.get("networkProfile") or {}), "networkInterfaces": nics},
                     instanceView={"statuses": [{"code": "ProvisioningState/succeeded"},
                                                {"code": f"PowerState/{self.start_power}"}]})
        vm = {"id": path, "name": name, "type": "Microsoft.Compute/virtualMachines", "location": body["location"],
              "tags": dict(body.get("tags") or {}), "properties": props}
        if body.get("zones"):
            vm["zones"] = list(body["zones"])
        if ident := body.get("identity"):  # as ARM answers: each identity with its principal
            vm["identity"] = {"type": ident["type"], "userAssignedIdentities": {
                k: {"principalId": f"p-{i}", "clientId": f"c-{i}"}
                for i, k in enumerate(ident.get("userAssignedIdentities") or {})}}
        self.vms[key] = vm
        return 201, vm

    def _remove(self, key: tuple[str, str, str]) -> None:
        vm = self.vms.pop(key)
        self.custom.pop(key, None)
        for ref in vm["properties"]["networkProfile"]["networkInterfaces"]:
            self.nics.pop((key[0], key[1], ref["id"].rsplit("/", 1)[-1]), None)
