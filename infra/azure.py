"""Microsoft Azure as a Koi fleet: the Executor port and the observer half a cloud can answer.

The Azure twin of :mod:`infra.aws` and :mod:`infra.gcp` (the same contract, run by the same tests,
``tests/test_infra_fleet_contract.py``) over ``azure-mgmt-compute`` (virtual machines) and ``azure-mgmt-network``
(their NICs' private addresses), in one resource group. Nothing lives in memory between calls: every read rebuilds
the fleet from ``virtual_machines.list(expand="instanceView")``, so a restarted worker sees what the last one left.

Azure tags are EC2's kind (≤ 50 per resource, values ≤ 256 characters, ``:`` allowed), so a VM carries exactly
:mod:`infra.aws`'s tags (``koi:cluster``, ``koi:job``, ``koi:rank``, ``koi:pool``, ``koi:env``, ``koi:key``, the
rank's spec split over ``koi:rank-spec…``, the target replica count with its generation, the route weight, the
drain records, ``koi:model``) plus ``koi:node`` (node 0 of a replica is its head, where vLLM serves). A VM's name
(unique in the resource group) is ``koi-<cluster8>-<rank10>-<key6>-g<gen>-r<replica>-n<node>`` (hex hashes).

Choices (Azure's API, not the spec, decides these):

1. **One PUT per VM**, with the NIC inline (``networkInterfaceConfigurations``, ``deleteOption: Delete``) and the OS
   disk deleted with the VM, so deleting a VM leaves nothing behind. A PUT retried after a lost answer updates the
   VM the first one made (the name is derived from the key): idempotent like EC2's ClientToken. A launch is
   DUPLICATE when a VM carries its key; a refused PUT (quota, capacity: ``OperationNotAllowed``,
   ``SkuNotAvailable``, ``AllocationFailed``) deletes what the call had made and fails the launch with
   ``Code: message``.
2. **Spot pools** launch ``priority: Spot``, ``evictionPolicy: Delete``, ``maxPrice: -1`` (pay up to on-demand):
   an eviction deletes the VM, which the next read sees as a broken replica for ``scale`` to repair. Reserved pools
   launch as regular VMs (the reservation applies by itself).
3. A VM is **up** while provisioning (``Creating``/``Updating``/``Succeeded``) and not stopped or deallocated,
   **ready** once ``Succeeded`` and ``PowerState/running``, **leaving** while ``Deleting``; every VM listed holds
   its place in the pool's budget.
4. ``delete`` is sent without waiting for the long-running operation (the VM shows ``Deleting``); teardown and
   reweight raise Azure's errors so the activity retries rather than leaking paid VMs.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

from infra import backstop
from infra.aws import (
    T_BASE,
    T_CLUSTER,
    T_DRAIN,
    T_ENV,
    T_GEN,
    T_JOB,
    T_KEY,
    T_LAST_KEY,
    T_LAUNCH_KEY,
    T_MODEL,
    T_NODES,
    T_POOL,
    T_RANK,
    T_RDRAIN,
    T_RELEASE,
    T_REPLICA,
    T_REPLICAS,
    T_REWEIGHT,
    T_TEARDOWN,
    T_WEIGHT,
    rank_from_tags,
    spec_tags,
    tag_value,
)
from infra.engine import EngineError, EngineSpec, Node, script_for
from infra.replicas import Check, RankReads, ReplicaGroups
from koi.domain import Market, Pool, Rank, ResourceMap
from koi.logging import get_logger

#: Azure's HPC image for Ubuntu 22.04 (NVIDIA drivers, CUDA, InfiniBand), as an image reference.
DEFAULT_IMAGE = {"publisher": "microsoft-dsvm", "offer": "ubuntu-hpc", "sku": "2204", "version": "latest"}
T_NODE = "koi:node"
UP_PROVISIONING = ("Creating", "Updating", "Succeeded")
STOPPED = ("stopping", "stopped", "deallocating", "deallocated")
_NO_ZONE = {"any", "*", ""}


def _sha(v: str) -> str:
    return hashlib.sha256(v.encode()).hexdigest()


def vm_name(cluster_id: str, rank_id: str, key: str, gen: int, replica: int, node: int) -> str:
    return f"koi-{_sha(cluster_id)[:8]}-{_sha(rank_id)[:10]}-{_sha(key)[:6]}-g{gen}-r{replica}-n{node}"


def image_reference(image: str | Mapping[str, str]) -> dict[str, str]:
    """An image id (``/subscriptions/...``), a URN (``publisher:offer:sku:version``) or a reference mapping."""
    if isinstance(image, Mapping):
        return dict(image)
    if image.startswith("/"):
        return {"id": image}
    parts = image.split(":")
    if len(parts) != 4:
        raise ValueError(f"image {image!r}: an image id or a URN publisher:offer:sku:version")
    return dict(zip(("publisher", "offer", "sku", "version"), parts, strict=True))


_NIC_IPS: dict[str, str] = {}  # NIC resource id -> private address (AzureFleet._nic_ip)
_NIC_LOCK = threading.Lock()
_NIC_MAX = 20_000


def tags(vm: Mapping[str, Any]) -> dict[str, str]:
    return dict(vm.get("tags") or {})


def _state(vm: Mapping[str, Any]) -> tuple[str, str | None]:
    """(provisioning state, power state or None)."""
    props = vm.get("properties") or {}
    power = next((s["code"].split("/", 1)[1] for s in (props.get("instanceView") or {}).get("statuses") or []
                  if str(s.get("code", "")).startswith("PowerState/")), None)
    return str(props.get("provisioningState", "")), power


def _up(vm: Mapping[str, Any]) -> bool:
    prov, power = _state(vm)
    return prov in UP_PROVISIONING and power not in STOPPED


def _running(vm: Mapping[str, Any]) -> bool:
    return _state(vm) == ("Succeeded", "running")


def _leaving(vm: Mapping[str, Any]) -> bool:
    return _state(vm)[0] == "Deleting"


def azure_reason(e: HttpResponseError) -> str:
    code = getattr(getattr(e, "error", None), "code", None) or getattr(e, "status_code", "")
    msg = getattr(getattr(e, "error", None), "message", None) or e.message
    return f"{code}: {msg}"


class _Rank(ReplicaGroups[dict[str, Any]]):
    """One rank as Azure lists it: its VMs (not on their way out) grouped by replica (:mod:`infra.replicas`)."""

    def __init__(self, vms: list[dict[str, Any]]) -> None:
        self.insts = vms
        self.head = tags(max(vms, key=lambda v: (int(tags(v).get(T_GEN, "0")), _up(v))))
        super().__init__(vms, nodes=int(self.head[T_NODES]), replica_of=lambda v: int(tags(v)[T_REPLICA]),
                         up=_up, running=_running)


class AzureFleet(RankReads):
    """Executor + Observer over Azure VMs for one Koi cluster in one resource group; ``pools`` bound it.

    ``compute``/``network``: a ``ComputeManagementClient`` and a ``NetworkManagementClient``. ``subnet_id``: the
    subnet the engines' NICs join; ``ssh_public_key``: the admin's key (password login is off). ``vm_args`` are
    merged into every VM's ``properties`` (``securityProfile``, ``diagnosticsProfile``, ...; ``tags`` into its
    tags, Koi's win). ``telemetry`` is empty (engine metrics come from :mod:`infra.vllm_metrics`)."""

    CLOUD, JOB_KEY, LAUNCH_KEY, DRAIN_KEY = "azure", T_JOB, T_LAUNCH_KEY, T_DRAIN
    POOL_KEY, KEY_KEY, LAST_KEY, GEN_KEY = T_POOL, T_KEY, T_LAST_KEY, T_GEN
    REPLICAS_KEY, RDRAIN_KEY, WEIGHT_KEY, MODEL_KEY = T_REPLICAS, T_RDRAIN, T_WEIGHT, T_MODEL
    TEARDOWN_KEY, RELEASE_KEY = T_TEARDOWN, T_RELEASE
    RANK_KEY, REPLICA_KEY = T_RANK, T_REPLICA

    def __init__(self, cluster_id: str, pools: ResourceMap, *, resource_group: str, subnet_id: str, compute: Any,
                 network: Any, ssh_public_key: str, admin_username: str = "koi",
                 image: str | Mapping[str, str] = DEFAULT_IMAGE, clock: Callable[[], float] = time.time,
                 vm_args: Mapping[str, Any] | None = None, os_disk_gb: int = 256, engine: EngineSpec | None = None,
                 engine_port: int = 8000, identity: str | None = None) -> None:
        self.cluster_id, self.pools, self.rg, self.subnet_id = cluster_id, pools, resource_group, subnet_id
        self.identity = identity
        self.compute, self.network = compute, network
        self.ssh_public_key, self.admin_username = ssh_public_key, admin_username
        self.image = image_reference(image)
        self.vm_args = dict(vm_args or {})
        self.os_disk_gb = os_disk_gb
        self.engine, self.engine_port = engine, engine_port
        self._clock = clock
        self._log = get_logger(__name__, cluster=cluster_id)

    # ---- Observer -------------------------------------------------------------------------------
    def capacity(self) -> ResourceMap:
        return self._capacity(Counter(tags(v).get(T_POOL) for v in self._list()))

    def _ranks(self, listed: list[dict[str, Any]] | None = None) -> dict[str, _Rank]:
        """The cluster's ranks (VMs not on their way out, nor draining after a scale-in), by rank id."""
        by_rank: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for v in self._list() if listed is None else listed:
            if not _leaving(v) and T_RANK in (t := tags(v)) and T_RDRAIN not in t:
                by_rank[t[T_RANK]].append(v)
        return {rid: _Rank(vms) for rid, vms in sorted(by_rank.items())}

    @staticmethod
    def _rank_of(head: Mapping[str, str]) -> Rank:
        return rank_from_tags(head)

    def _head_addr(self, r: _Rank, k: int) -> str | None:
        """Replica ``k``'s head node (node 0, where vLLM serves) by its NIC's private address."""
        head = min(r.replicas[k], key=lambda v: int(tags(v).get(T_NODE, "0")))
        nics = ((head.get("properties") or {}).get("networkProfile") or {}).get("networkInterfaces") or []
        return self._nic_ip(nics[0]["id"]) if nics else None

    def _nic_ip(self, nic_id: str) -> str | None:
        """A NIC's private address, asked of ARM once per NIC in the process (it keeps it for its life, and every
        read of the fleet — the sweep, the gateway, each tick — would otherwise ask again for each replica)."""
        with _NIC_LOCK:
            if nic_id in _NIC_IPS:
                return _NIC_IPS[nic_id]
        parts = nic_id.split("/")
        try:
            nic = self.network.network_interfaces.get(parts[4], parts[-1]).as_dict()
        except ResourceNotFoundError:  # deleted between the list and now
            return None
        ips = [c.get("properties", {}).get("privateIPAddress") for c in nic.get("properties", {}).get(
            "ipConfigurations") or []]
        ip = next((str(i) for i in ips if i), None)
        if ip is not None:
            with _NIC_LOCK:
                if len(_NIC_IPS) >= _NIC_MAX:  # a long-lived worker: forget the oldest half
                    for k in list(_NIC_IPS)[: _NIC_MAX // 2]:
                        del _NIC_IPS[k]
                _NIC_IPS[nic_id] = ip
        return ip

    # ---- Executor -------------------------------------------------------------------------------
    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        tv = tag_value(idempotency_key)
        mine = [v for v in self._list() if tags(v).get(T_RANK) == rank_id and tags(v).get(T_JOB) == job_id and _up(v)]
        if not any(_running(v) for v in mine) or any(tags(v).get(T_REWEIGHT) == tv for v in mine):
            return False
        self._tag(mine, {T_WEIGHT: repr(float(route_weight)), T_REWEIGHT: tv})
        self._log.info("azure.reweight", job=job_id, rank=rank_id, route_weight=route_weight)
        return True

    # ---- Azure ----------------------------------------------------------------------------------
    # the cloud's side of RankReads.launch, .scale, .teardown and .sweep
    def _launch_reads(self, pool: Pool, stored: str,
                      rank_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Callable[[], int]]:
        """One listing of the resource group answers all three (the resource group holds every region's VMs)."""
        listed = self._list()
        return ([v for v in listed if tags(v).get(T_KEY) == stored],
                [v for v in listed if tags(v).get(T_RANK) == rank_id], lambda: self._free(pool, listed))

    def _fleet_listing(self) -> list[Any]:
        return self._list()

    def _rank_listing(self, rank_id: str) -> list[dict[str, Any]]:
        return [v for v in self._list() if tags(v).get(T_RANK) == rank_id]

    def _meta(self, inst: Mapping[str, Any]) -> dict[str, str]:
        return tags(inst)

    def _staying(self, inst: Mapping[str, Any]) -> bool:
        return not _leaving(inst)

    def _groups(self, insts: list[dict[str, Any]]) -> _Rank:
        return _Rank(insts)

    def _ident(self, inst: Mapping[str, Any]) -> str:
        return inst["name"]

    def _stored(self, key: str) -> str:
        return tag_value(key)

    def _free_in(self, pool: Pool) -> int:
        return self._free(pool, self._list())

    def _release(self, insts: list[dict[str, Any]]) -> None:
        self._delete(insts)

    def _mark(self, insts: list[dict[str, Any]], updates: Mapping[str, str]) -> None:
        self._tag(insts, updates)

    def _preflight_fleet(self) -> list[Check]:
        """The image in each region the pools use: a marketplace image's versions listed there (an image id is
        not checked: its access is the gallery's)."""
        ref = self.image
        if "id" in ref:
            return [Check(f"image {ref['id']}", True, "an image id: not checked before a launch")]
        out = []
        for region in sorted({p.env.region for p in self.pools.pools}):
            what = f"image {':'.join(ref[k] for k in ('publisher', 'offer', 'sku', 'version'))} in {region}"
            try:
                versions = [v.name for v in self.compute.virtual_machine_images.list(
                    region, ref["publisher"], ref["offer"], ref["sku"])]
            except HttpResponseError as e:
                out.append(Check(what, False, azure_reason(e)))
                continue
            ok = bool(versions) and (ref["version"] == "latest" or ref["version"] in versions)
            out.append(Check(what, ok, f"{len(versions)} version(s), newest {max(versions)}" if ok
                             else f"not offered there ({len(versions)} version(s) listed)"))
        return out

    def _preflight_pool(self, pool: Pool) -> list[Check]:
        """The VM size is offered in the pool's region and zone to this subscription (the resource SKUs'
        restrictions), with the GPUs the pool counts."""
        region, zone = pool.env.region, pool.env.zone
        what = f"pool {pool.pool_id}: {pool.instance_type} in {region}" + ("" if zone in _NO_ZONE else f" zone {zone}")
        try:
            skus = [k.as_dict() for k in self.compute.resource_skus.list(filter=f"location eq '{region}'")]
        except HttpResponseError as e:
            return [Check(what, False, azure_reason(e))]
        sku = next((k for k in skus if k.get("resourceType") == "virtualMachines"
                    and str(k.get("name", "")).lower() == pool.instance_type.lower()
                    and region.lower() in [x.lower() for x in k.get("locations") or []]), None)
        if sku is None:
            return [Check(what, False, "not offered in the region")]
        for r in sku.get("restrictions") or []:
            info = r.get("restrictionInfo") or {}
            if r.get("type") == "Location" or (r.get("type") == "Zone" and zone in (info.get("zones") or [])):
                return [Check(what, False, f"{r.get('reasonCode', 'restricted')}: {r.get('type')} "
                                           f"{', '.join(info.get('zones') or r.get('values') or [])}")]
        zones = [z for li in sku.get("locationInfo") or [] if li.get("location", "").lower() == region.lower()
                 for z in li.get("zones") or []]
        if zone not in _NO_ZONE and zone not in zones:
            return [Check(what, False, f"offered in zone(s) {', '.join(sorted(zones)) or 'none'} only")]
        gpus = next((int(c["value"]) for c in sku.get("capabilities") or [] if c.get("name") == "GPUs"), None)
        if gpus is not None and gpus != pool.gpus_per_instance:
            return [Check(what, False, f"the size carries {gpus} GPU(s), the pool counts {pool.gpus_per_instance}")]
        return [Check(what, True, "offered" + (f", {gpus} GPU(s)" if gpus is not None else ""))]

    def _reason(self, e: Exception) -> str | None:
        return azure_reason(e) if isinstance(e, HttpResponseError) else str(e) if isinstance(e, EngineError) else None

    def _list(self) -> list[dict[str, Any]]:
        """The cluster's VMs in the resource group, as ARM JSON (any state)."""
        vms = (vm.as_dict() for vm in self.compute.virtual_machines.list(self.rg, expand="instanceView"))
        return [v for v in vms if tags(v).get(T_CLUSTER) == self.cluster_id]

    def _free(self, pool: Pool, listed: list[dict[str, Any]]) -> int:
        return max(0, pool.total_instances - sum(tags(v).get(T_POOL) == pool.pool_id for v in listed))

    def _tag(self, vms: list[dict[str, Any]], updates: Mapping[str, str]) -> None:
        """Merge ``updates`` into each VM's tags (ARM's PATCH replaces the whole set)."""
        for v in vms:
            self.compute.virtual_machines.begin_update(self.rg, v["name"], {"tags": {**tags(v), **updates}}).result()

    def _delete(self, vms: list[dict[str, Any]]) -> None:
        """Delete without waiting (each shows Deleting until gone); one already gone is fine."""
        for v in vms:
            try:
                self.compute.virtual_machines.begin_delete(self.rg, v["name"])
            except ResourceNotFoundError:
                continue

    def _create_replicas(self, pool: Pool, job_id: str, rid: str, rank: Rank, *, key: str, launch_key: str, base: int,
                count: int, target: int, gen: int, weight: float | None, last_key: str | None = None,
                model: str | None = None) -> None:
        """Create ``count`` replicas of ``nodes`` VMs; on any refusal delete what this call made, raise. With an
        engine spec, the custom data starts vLLM as the rank asks (:mod:`infra.engine`)."""
        nodes = self._nodes(rank, pool)

        def script(replica: int, node: int) -> str | None:  # node 0's name resolves in the VNet (Azure DNS)
            return script_for(self.engine, self.engine_port, self.cluster_id, job_id, rid, model, rank, Node(
                index=str(node), count=nodes, gpus=pool.gpus_per_instance,
                head=vm_name(self.cluster_id, rid, key, gen, replica, 0)), watch)

        watch = None if self.engine is None else backstop.watchdog("azure", self.engine.log_file, self.identity)

        script(base, 0)  # a rank Koi cannot start fails here, before anything is created
        extra = dict(self.vm_args)
        base_tags = {**dict(extra.pop("tags", None) or {}), T_CLUSTER: self.cluster_id, T_JOB: job_id, T_RANK: rid,
                     T_POOL: pool.pool_id, T_ENV: rank.env.env_id[:256], T_KEY: tag_value(key),
                     T_LAUNCH_KEY: tag_value(launch_key), T_BASE: str(base), T_NODES: str(nodes),
                     T_REPLICAS: str(target), T_GEN: str(gen), **spec_tags(rank)}
        for k, v in ((T_WEIGHT, None if weight is None else repr(float(weight))), (T_LAST_KEY, last_key),
                     (T_MODEL, model)):
            if v is not None:
                base_tags[k] = v
        made: list[dict[str, Any]] = []
        try:
            for replica in range(base, base + count):
                for node in range(nodes):
                    name = vm_name(self.cluster_id, rid, key, gen, replica, node)
                    body = self._vm_body(pool, name, {**base_tags, T_REPLICA: str(replica), T_NODE: str(node)},
                                         extra, script(replica, node))
                    self.compute.virtual_machines.begin_create_or_update(self.rg, name, body).result()
                    made.append({"name": name})
        except HttpResponseError:
            self._delete(made)
            self._log.warning("azure.create.rolled_back", rank=rid, key=key, deleted=len(made))
            raise

    def _vm_body(self, pool: Pool, name: str, vm_tags: dict[str, str], extra: dict[str, Any],
                 script: str | None) -> dict[str, Any]:
        os_profile: dict[str, Any] = {
            "computerName": name, "adminUsername": self.admin_username,
            "linuxConfiguration": {"disablePasswordAuthentication": True, "ssh": {"publicKeys": [{
                "path": f"/home/{self.admin_username}/.ssh/authorized_keys", "keyData": self.ssh_public_key}]}}}
        if script is not None:
            os_profile["customData"] = base64.b64encode(script.encode()).decode()
        props: dict[str, Any] = {
            "hardwareProfile": {"vmSize": pool.instance_type},
            "storageProfile": {"imageReference": self.image, "osDisk": {
                "createOption": "FromImage", "deleteOption": "Delete", "diskSizeGB": self.os_disk_gb}},
            "osProfile": os_profile,
            "networkProfile": {"networkApiVersion": "2020-11-01", "networkInterfaceConfigurations": [{
                "name": f"{name}-nic", "properties": {"primary": True, "deleteOption": "Delete", "ipConfigurations": [
                    {"name": "ipconfig1", "properties": {"subnet": {"id": self.subnet_id}}}]}}]},
            **extra,
        }
        if pool.env.market is Market.SPOT:
            props.update(priority="Spot", evictionPolicy="Delete", billingProfile={"maxPrice": -1})
        body: dict[str, Any] = {"location": pool.env.region, "tags": vm_tags, "properties": props}
        if self.identity:  # the release backstop deletes the VM with it (infra/backstop.py)
            body["identity"] = {"type": "UserAssigned", "userAssignedIdentities": {self.identity: {}}}
        if pool.env.zone not in _NO_ZONE:
            body["zones"] = [pool.env.zone]
        return body

