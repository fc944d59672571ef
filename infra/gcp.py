"""Google Compute Engine as a Koi fleet: the Executor port and the observer half a cloud can answer.

The GCE twin of :mod:`infra.aws` (same contract and structure) over ``google-cloud-compute``'s
``InstancesClient`` (REST; tests point it at ``tests/fakes/gce_server.py``). Nothing lives in memory
between calls: every read rebuilds the fleet from ``instances.list``, so a restarted worker sees what
the last one left.

GCE labels are stricter than EC2 tags (``[a-z0-9_-]``, ≤ 63 characters), so they carry only what is
filtered on: ``koi_cluster`` (the cluster id when it is a legal value, else ``h-`` + a hash),
``koi_rank``, ``koi_key``, ``koi_pool`` (hashes of the rank id, the creating call's idempotency key
and the pool id). Label keys use underscores, not hyphens: a filter's field path (``labels.koi_rank``)
is then a plain identifier under both of the list API's filter grammars. The full identities and the rank live in instance **metadata** (values up to
256 KB; each label match is checked against them, so a hash collision cannot mix ranks up):
``koi-cluster``, ``koi-job``, ``koi-rank-id``, ``koi-pool-id``, ``koi-env``, ``koi-key``, ``koi-launch-key``;
``koi-replica``/``koi-node``/``koi-nodes`` (one replica = ceil(gpus / gpus_per_instance) instances,
node 0 the head where vLLM serves); ``koi-replicas`` with ``koi-gen`` (the highest generation's
target wins), ``koi-last-key``, ``koi-route-weight``, ``koi-reweight-key``, ``koi-teardown-key``;
``koi-rank-spec`` (the rank without ``n_replicas``/``route_weight``, one JSON value). Instance names
(unique per zone) are ``koi-<cluster8>-<rank10>-<key6>-g<gen>-r<replica>-n<node>`` (hex hashes).

Idempotency: a launch is DUPLICATE when any instance carries its key, and each insert carries a
``request_id`` (uuid5 of cluster, key, replica, node), so a retry racing a lost response creates
nothing new. Unlike EC2 (which lists terminated instances for about an hour), GCE forgets a deleted
instance once it is gone, so key memory lasts only while instances exist: a launch key whose
instances are all gone launches again, and a stale rerun of a teardown key after the rank was
launched anew tears the new rank down (the ledger answers DUPLICATE for repeated keys first). GCE
also remembers request ids of failed inserts, so repeating a FAILED launch's key within that window
(≥ 1 h) replays the failure; the next tick's new key tries again.

Operations: all inserts of a call are sent, then each ExtendedOperation is waited on
(``.result(timeout=op_timeout)``): GCE reports stockouts (``ZONE_RESOURCE_POOL_EXHAUSTED``) on the
operation, not the request. A call that fails part way deletes what it created (``bulkInsert`` is
all-or-nothing but cannot give instances their own metadata), so a FAILED launch leaves nothing.
``setMetadata`` (scale bookkeeping, reweight, the teardown mark) is waited on too, so the next read
sees it; it sends the fingerprint read with the instance, so a concurrent writer makes it fail
(``412``) instead of being overwritten. Deletes are not waited on (the instance lists ``STOPPING``
until gone). The library polls through its own ``ZoneOperationsClient`` on the default endpoint;
the test fake answers every operation ``DONE``, so tests never poll.

Listing: ``instances.list`` per zone the pools name, filtered on ``labels.koi_cluster`` (plus the
label looked up); ``aggregatedList`` would scan every zone of the project. A pool's ``env.zone`` is
a GCE zone (``us-central1-a``); a pool naming none cannot launch. Spot pools get
``provisioning_model=SPOT``, ``instance_termination_action=DELETE``; all get
``on_host_maintenance=TERMINATE`` (required with GPUs). The pool's ``instance_type`` is the machine
type (``a2-``/``a3-``/``g2-`` bring their GPUs; N1 needs ``guest_accelerators`` via ``insert_args``).

Status: ``PROVISIONING``/``STAGING`` are alive, not ready; ``RUNNING`` is ready; anything else is
gone for its replica. ``STOPPING`` (being deleted) instances belong to no deployment but still hold
their pool's GPUs; ``TERMINATED``/``SUSPENDED`` ones stay in their rank as a broken replica (which
``scale`` and ``teardown`` delete) and hold none; ``STOPPING``/``SUSPENDING``/``REPAIRING`` do.

A ``GoogleAPICallError`` makes launch or scale FAILED with ``REASON: message``; teardown and reweight
raise it, so the activity retries rather than leaking paid instances. A teardown hands over and drains
(:mod:`infra.drain`: a ``koi-drain`` metadata record moved on by :meth:`GceFleet.sweep`) unless ``drain_s`` is 0
without a handover; a scale-in drains the replicas it removes (``koi-replica-drain-until``), deleted by the same
sweep.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from google.api_core.exceptions import DeadlineExceeded, GoogleAPICallError, NotFound
from google.cloud import compute_v1

from infra import backstop
from infra.engine import EngineError, EngineSpec, Node, script_for
from infra.replicas import Check, RankReads, ReplicaGroups
from koi.domain import Market, Pool, Rank, ResourceMap
from koi.logging import get_logger

#: Google's Deep Learning VM "common" image family (CUDA 12.4 + NVIDIA driver, Debian 11; list the
#: current families with ``gcloud compute images list --project deeplearning-platform-release``).
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"

L_CLUSTER, L_RANK, L_KEY, L_POOL = "koi_cluster", "koi_rank", "koi_key", "koi_pool"  # underscores: filter-safe field names
M_CLUSTER, M_JOB, M_RANK, M_POOL = "koi-cluster", "koi-job", "koi-rank-id", "koi-pool-id"
M_ENV, M_DRAIN, M_RDRAIN, M_RELEASE = "koi-env", "koi-drain", "koi-replica-drain-until", "koi-release-by"
M_MODEL = "koi-model"
M_KEY, M_LAUNCH_KEY, M_LAST_KEY = "koi-key", "koi-launch-key", "koi-last-key"
M_REPLICA, M_NODE, M_NODES = "koi-replica", "koi-node", "koi-nodes"
M_REPLICAS, M_GEN, M_SPEC = "koi-replicas", "koi-gen", "koi-rank-spec"
M_WEIGHT, M_REWEIGHT, M_TEARDOWN = "koi-route-weight", "koi-reweight-key", "koi-teardown-key"
#: Which metadata item holds the full value behind each hashed label.
_LABEL_META = {L_CLUSTER: M_CLUSTER, L_RANK: M_RANK, L_KEY: M_KEY, L_POOL: M_POOL}

UP = ("PROVISIONING", "STAGING", "RUNNING")
#: Statuses in which an instance still holds GPUs of its pool.
OCCUPYING = (*UP, "STOPPING", "SUSPENDING", "REPAIRING")
#: Statuses in which an instance is not (yet) part of a deployment: on its way out.
LEAVING = ("STOPPING",)
_LABEL_OK = re.compile(r"[a-z0-9_-]{1,63}")
_NO_ZONE = {"any", "*", ""}
_REQUEST_NS = uuid.UUID("6f1c52f8-5a4e-4d43-9a55-0f5b7c2d8e11")


def _sha(v: str) -> str:
    return hashlib.sha256(v.encode()).hexdigest()


def label_value(v: str) -> str:
    """``v`` itself when GCE accepts it as a label value, else ``h-`` + a hash (both ≤ 63 characters)."""
    return v if _LABEL_OK.fullmatch(v) else "h-" + _sha(v)[:40]


def label_hash(v: str) -> str:
    """A short label value for an id that is usually illegal as one (``job-1/abc``, keys with ``#``)."""
    return "h-" + _sha(v)[:24]


def request_id(cluster_id: str, key: str, replica: int, node: int) -> str:
    """GCE's idempotency token for one insert: a UUID, the same for every retry of the same call."""
    return str(uuid.uuid5(_REQUEST_NS, f"{cluster_id}\n{key}\n{replica}\n{node}"))


def instance_name(cluster_id: str, rank_id: str, key: str, gen: int, replica: int, node: int) -> str:
    return f"koi-{_sha(cluster_id)[:8]}-{_sha(rank_id)[:10]}-{_sha(key)[:6]}-g{gen}-r{replica}-n{node}"


def spec_value(rank: Rank) -> str:
    return json.dumps(rank.model_dump(mode="json", exclude={"n_replicas", "route_weight"}, exclude_none=True),
                      separators=(",", ":"), sort_keys=True)


def rank_from_metadata(md: Mapping[str, str]) -> Rank:
    d = json.loads(md[M_SPEC])
    d["n_replicas"] = int(md[M_REPLICAS])
    if M_WEIGHT in md:
        d["route_weight"] = float(md[M_WEIGHT])
    return Rank.model_validate(d)




def metadata(inst: compute_v1.Instance) -> dict[str, str]:
    return {i.key: i.value for i in inst.metadata.items}


def _zone_of(inst: compute_v1.Instance) -> str:
    return inst.zone.rsplit("/", 1)[-1]


class _Rank(ReplicaGroups[compute_v1.Instance]):
    """One rank as GCE lists it: its instances (not on their way out) grouped by replica (:mod:`infra.replicas`)."""

    def __init__(self, insts: list[compute_v1.Instance]) -> None:
        self.insts = insts
        self.head = metadata(max(insts, key=lambda i: (int(metadata(i).get(M_GEN, "0")), i.status in UP)))
        super().__init__(insts, nodes=int(self.head[M_NODES]), replica_of=lambda i: int(metadata(i)[M_REPLICA]),
                         up=lambda i: i.status in UP, running=lambda i: i.status == "RUNNING")


class GceFleet(RankReads):
    """Executor + Observer over Compute Engine for one Koi cluster in one project; ``pools`` bound it.

    ``telemetry`` is empty (engine metrics come from ``infra.vllm_metrics``). ``insert_args`` are
    ``compute_v1.Instance`` fields applied to every insert over the defaults (``disks``,
    ``network_interfaces``, ``service_accounts``, ``guest_accelerators`` for N1 pools, ``tags``, ...);
    their ``metadata`` (a mapping, e.g. ``{"startup-script": ...}``) and ``labels`` are merged with
    koi's own (koi's win). Without ``client``, an ``InstancesClient`` with the default credentials.
    """

    CLOUD, JOB_KEY, LAUNCH_KEY, DRAIN_KEY = "gcp", M_JOB, M_LAUNCH_KEY, M_DRAIN
    POOL_KEY, KEY_KEY, LAST_KEY, GEN_KEY = M_POOL, M_KEY, M_LAST_KEY, M_GEN
    REPLICAS_KEY, RDRAIN_KEY, WEIGHT_KEY, MODEL_KEY = M_REPLICAS, M_RDRAIN, M_WEIGHT, M_MODEL
    TEARDOWN_KEY, RELEASE_KEY = M_TEARDOWN, M_RELEASE
    RANK_KEY, REPLICA_KEY = M_RANK, M_REPLICA

    def __init__(self, cluster_id: str, pools: ResourceMap, *, project: str,
                 client: compute_v1.InstancesClient | None = None, image: str = DEFAULT_IMAGE,
                 clock: Callable[[], float] = time.time, insert_args: Mapping[str, Any] | None = None,
                 boot_disk_gb: int = 200, op_timeout: float = 600.0, engine: EngineSpec | None = None,
                 engine_port: int = 8000, api_endpoint: str | None = None, credentials: Any = None) -> None:
        self.cluster_id = cluster_id
        self._api = {"api_endpoint": api_endpoint, "credentials": credentials}  # the preflight's other clients
        self.engine, self.engine_port = engine, engine_port
        self.pools = pools
        self.project = project
        self.image = image
        self.boot_disk_gb = boot_disk_gb
        self.op_timeout = op_timeout
        self.insert_args = dict(insert_args or {})
        self._client_obj = client
        self._clock = clock
        self._log = get_logger(__name__, cluster=cluster_id)

    @property
    def client(self) -> compute_v1.InstancesClient:
        if self._client_obj is None:  # lazily: the default credentials are only needed for a call
            self._client_obj = compute_v1.InstancesClient()
        return self._client_obj

    # ---- Observer -------------------------------------------------------------------------------
    def capacity(self) -> ResourceMap:
        return self._capacity(Counter(metadata(i).get(M_POOL) for i in self._list_all({}) if i.status in OCCUPYING))

    def _ranks(self, listed: list[compute_v1.Instance] | None = None) -> dict[str, _Rank]:
        """The cluster's ranks (instances not on their way out, nor draining after a scale-in), by rank id."""
        by_rank: dict[str, list[compute_v1.Instance]] = defaultdict(list)
        for i in self._list_all({}) if listed is None else listed:
            if i.status not in LEAVING and M_RANK in (md := metadata(i)) and M_RDRAIN not in md:
                by_rank[md[M_RANK]].append(i)
        return {rid: _Rank(insts) for rid, insts in sorted(by_rank.items())}

    @staticmethod
    def _rank_of(head: Mapping[str, str]) -> Rank:
        return rank_from_metadata(head)

    @staticmethod
    def _head_addr(r: _Rank, k: int) -> str | None:
        """Replica ``k``'s head node (node 0, where vLLM's API server and ``/metrics`` run) by internal address
        (``networkIP``), else its external one."""
        head = min(r.replicas[k], key=lambda i: int(metadata(i).get(M_NODE, "0")))
        nic = head.network_interfaces[0] if head.network_interfaces else None
        addr = nic and (nic.network_i_p or (nic.access_configs[0].nat_i_p if nic.access_configs else ""))
        return str(addr) if addr else None

    # ---- Executor -------------------------------------------------------------------------------
    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        mine = [i for i in self._list_all({L_RANK: rank_id}) if i.status in UP and metadata(i).get(M_JOB) == job_id]
        if not any(i.status == "RUNNING" for i in mine) or any(
                metadata(i).get(M_REWEIGHT) == idempotency_key for i in mine):
            return False
        self._set_metadata(mine, {M_WEIGHT: repr(float(route_weight)), M_REWEIGHT: idempotency_key})
        self._log.info("gcp.reweight", job=job_id, rank=rank_id, route_weight=route_weight)
        return True

    # ---- GCE ------------------------------------------------------------------------------------
    # the cloud's side of RankReads.launch, .scale, .teardown and .sweep
    def _unplaceable(self, pool: Pool) -> str | None:
        return f"pool {pool.pool_id} names no zone to launch in" if pool.env.zone in _NO_ZONE else None

    def _keyed(self, pool: Pool, stored: str) -> list[compute_v1.Instance]:
        return self._list(pool.env.zone, {L_KEY: stored})

    def _rank_in(self, pool: Pool, rank_id: str) -> list[compute_v1.Instance]:
        return self._list(pool.env.zone, {L_RANK: rank_id})

    def _fleet_listing(self) -> list[Any]:
        return self._list_all({})

    def _rank_listing(self, rank_id: str) -> list[compute_v1.Instance]:
        return self._list_all({L_RANK: rank_id})

    def _meta(self, inst: compute_v1.Instance) -> dict[str, str]:
        return metadata(inst)

    def _staying(self, inst: compute_v1.Instance) -> bool:
        return inst.status not in LEAVING

    def _groups(self, insts: list[compute_v1.Instance]) -> _Rank:
        return _Rank(insts)

    def _ident(self, inst: compute_v1.Instance) -> str:
        return inst.name

    def _free_in(self, pool: Pool) -> int:
        return self._free(pool)

    def _release(self, insts: list[compute_v1.Instance]) -> None:
        self._delete([(_zone_of(i), i.name) for i in insts])

    def _mark(self, insts: list[compute_v1.Instance], updates: Mapping[str, str]) -> None:
        if insts:
            self._set_metadata(insts, updates)

    def _other_client(self, cls: Any) -> Any:
        """Another Compute Engine client (machine types, images) at the same endpoint, over REST."""
        from google.api_core.client_options import ClientOptions

        endpoint, creds = self._api["api_endpoint"], self._api["credentials"]
        return cls(transport="rest", credentials=creds,
                   client_options=ClientOptions(api_endpoint=endpoint) if endpoint else None)

    def _preflight_fleet(self) -> list[Check]:
        """The boot image (a family's newest, or the image itself) exists and the project may read it."""
        m = re.match(r"^(?:https://[^/]+/compute/v1/)?projects/([^/]+)/global/images/(family/)?([^/]+)$", self.image)
        what = f"image {self.image}"
        if m is None:
            return [Check(what, False, "not projects/P/global/images/[family/]NAME")]
        images = self._other_client(compute_v1.ImagesClient)
        project, family, name = m.groups()
        try:
            img = (images.get_from_family(project=project, family=name) if family
                   else images.get(project=project, image=name))
        except GoogleAPICallError as e:
            return [Check(what, False, gce_reason(e))]
        return [Check(what, True, f"{img.name} ({img.status})")]

    def _preflight_pool(self, pool: Pool) -> list[Check]:
        """The machine type is offered in the pool's zone, with the GPUs the pool counts."""
        what = f"pool {pool.pool_id}: {pool.instance_type} in {pool.env.zone}"
        try:
            mt = self._other_client(compute_v1.MachineTypesClient).get(project=self.project, zone=pool.env.zone,
                                                                        machine_type=pool.instance_type)
        except GoogleAPICallError as e:
            return [Check(what, False, gce_reason(e))]
        gpus = sum(a.guest_accelerator_count for a in mt.accelerators)
        if not mt.accelerators:
            return [Check(what, True, "offered, with no GPUs of its own: attach them with run_args "
                                      "(guest_accelerators)")]
        if gpus != pool.gpus_per_instance:
            return [Check(what, False, f"the type carries {gpus} GPU(s), the pool counts {pool.gpus_per_instance}")]
        kinds = ", ".join(sorted({a.guest_accelerator_type for a in mt.accelerators}))
        return [Check(what, True, f"offered, {gpus} x {kinds}")]

    def _reason(self, e: Exception) -> str | None:
        return gce_reason(e) if isinstance(e, GoogleAPICallError) else str(e) if isinstance(e, EngineError) else None

    @property
    def _zones(self) -> list[str]:
        return sorted({p.env.zone for p in self.pools.pools if p.env.zone not in _NO_ZONE})

    def _labels(self, ids: Mapping[str, str]) -> dict[str, str]:
        full = {L_CLUSTER: self.cluster_id, **ids}
        return {k: label_value(v) if k == L_CLUSTER else label_hash(v) for k, v in full.items()}

    def _list(self, zone: str, ids: Mapping[str, str]) -> list[compute_v1.Instance]:
        """This cluster's instances in ``zone`` (any status) whose ids (label -> full value) match."""
        want = {L_CLUSTER: self.cluster_id, **ids}
        flt = " AND ".join(f'(labels.{k} = "{v}")' for k, v in self._labels(ids).items())
        req = compute_v1.ListInstancesRequest(project=self.project, zone=zone, filter=flt)
        return [i for i in self.client.list(request=req)
                if all(metadata(i).get(_LABEL_META[k]) == v for k, v in want.items())]

    def _list_all(self, ids: Mapping[str, str]) -> list[compute_v1.Instance]:
        return [i for zone in self._zones for i in self._list(zone, ids)]

    def _free(self, pool: Pool) -> int:
        used = sum(i.status in OCCUPYING for i in self._list(pool.env.zone, {L_POOL: pool.pool_id}))
        return max(0, pool.total_instances - used)

    def _wait(self, ops: list[Any]) -> None:
        """Wait for every operation; raise the first error after all have settled."""
        first: GoogleAPICallError | None = None
        for op in ops:
            try:
                op.result(timeout=self.op_timeout)
            except GoogleAPICallError as e:
                first = first or e
            except TimeoutError:
                first = first or DeadlineExceeded(f"operation {op.name} not done after {self.op_timeout:g} s")
        if first is not None:
            raise first

    def _delete(self, targets: list[tuple[str, str]]) -> None:
        """Delete (zone, name)s without waiting (each shows STOPPING until gone); one already gone is fine."""
        for zone, name in targets:
            with contextlib.suppress(NotFound):
                self.client.delete(project=self.project, zone=zone, instance=name)

    def _set_metadata(self, insts: list[compute_v1.Instance], updates: Mapping[str, str]) -> None:
        ops = []
        for i in insts:
            items = [compute_v1.Items(key=k, value=v) for k, v in {**metadata(i), **updates}.items()]
            ops.append(self.client.set_metadata(project=self.project, zone=_zone_of(i), instance=i.name,
                                                metadata_resource=compute_v1.Metadata(
                                                    fingerprint=i.metadata.fingerprint, items=items)))
        self._wait(ops)

    def _create_replicas(self, pool: Pool, job_id: str, rid: str, rank: Rank, *, key: str, launch_key: str, base: int,
                count: int, target: int, gen: int, weight: float | None, last_key: str | None = None,
                model: str | None = None) -> None:
        """Insert ``count`` replicas of ``nodes`` instances; on any failure delete what this call made, raise. With
        an engine spec, a ``startup-script`` starts vLLM as the rank asks (:mod:`infra.engine`)."""
        nodes, zone = self._nodes(rank, pool), pool.env.zone

        def script(replica: int, node: int) -> str | None:  # node 0's name resolves in the VPC (zonal DNS)
            head = f"{instance_name(self.cluster_id, rid, key, gen, replica, 0)}.{zone}.c.{self.project}.internal"
            return script_for(self.engine, self.engine_port, self.cluster_id, job_id, rid, model, rank,
                              Node(index=str(node), count=nodes, gpus=pool.gpus_per_instance, head=head), watch)

        watch = None if self.engine is None else backstop.watchdog("gcp", self.engine.log_file)

        script(base, 0)  # a rank Koi cannot start fails here, before anything is inserted
        args = dict(self.insert_args)
        extra_md = {str(k): str(v) for k, v in dict(args.pop("metadata", None) or {}).items()}
        labels = {**dict(args.pop("labels", None) or {}),
                  **self._labels({L_RANK: rid, L_KEY: key, L_POOL: pool.pool_id})}
        md = {**extra_md, M_CLUSTER: self.cluster_id, M_JOB: job_id, M_RANK: rid, M_POOL: pool.pool_id,
              M_ENV: rank.env.env_id, M_KEY: key, M_LAUNCH_KEY: launch_key, M_NODES: str(nodes),
              M_REPLICAS: str(target), M_GEN: str(gen), M_SPEC: spec_value(rank)}
        if weight is not None:
            md[M_WEIGHT] = repr(float(weight))
        if last_key is not None:
            md[M_LAST_KEY] = last_key
        if model is not None:
            md[M_MODEL] = model
        spot = pool.env.market is Market.SPOT
        scheduling = compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=not spot)
        if spot:
            scheduling.provisioning_model = "SPOT"
            scheduling.instance_termination_action = "DELETE"
        args.setdefault("disks", [compute_v1.AttachedDisk(
            boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
                source_image=self.image, disk_size_gb=self.boot_disk_gb))])
        args.setdefault("network_interfaces", [compute_v1.NetworkInterface(network="global/networks/default")])
        args.setdefault("scheduling", scheduling)
        sent: list[tuple[str, Any]] = []
        try:
            for replica in range(base, base + count):
                for node in range(nodes):
                    name = instance_name(self.cluster_id, rid, key, gen, replica, node)
                    items = {**md, M_REPLICA: str(replica), M_NODE: str(node)}
                    if (text := script(replica, node)) is not None:
                        items["startup-script"] = text
                    inst = compute_v1.Instance(
                        **args, name=name, machine_type=f"zones/{zone}/machineTypes/{pool.instance_type}",
                        labels=labels, metadata=compute_v1.Metadata(
                            items=[compute_v1.Items(key=k, value=v) for k, v in items.items()]))
                    req = compute_v1.InsertInstanceRequest(project=self.project, zone=zone, instance_resource=inst,
                                                           request_id=request_id(self.cluster_id, key, replica, node))
                    sent.append((name, self.client.insert(request=req)))
            self._wait([op for _, op in sent])
        except GoogleAPICallError:
            made = []
            for name, op in sent:  # settled ones answer at once; the rest (an insert refused midway) settle
                try:
                    self._wait([op])
                    made.append(name)
                except GoogleAPICallError:  # this one failed: nothing to undo
                    continue
            self._delete([(zone, name) for name in made])
            self._log.warning("gcp.insert.rolled_back", rank=rid, key=key, deleted=len(made))
            raise



def gce_reason(e: GoogleAPICallError) -> str:
    """``REASON: message`` from the error's details (an operation's ``error.errors`` or an HTTP error
    body's ``errors``), else ``<http code>: message``."""
    parts = []
    for err in e.errors or []:
        if isinstance(err, Mapping):
            code, msg = err.get("reason"), err.get("message")
        else:  # compute_v1.Errors of a failed operation
            code, msg = getattr(err, "code", ""), getattr(err, "message", "")
        if code or msg:
            parts.append(f"{code or e.code}: {msg or e.message}")
    return "; ".join(parts) or f"{e.code}: {e.message}"
