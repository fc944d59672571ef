"""Amazon EC2 as a Koi fleet: the Executor port and the observer half a cloud can answer.

A real fleet keeps its state in the cloud (``koi.pipeline.world``): nothing here lives in
memory between calls. Every instance Koi launches carries tags that say whose it is and
what it serves, and every read rebuilds the fleet from ``describe_instances``, so a
worker that restarts (or another worker) sees exactly what the last one left:

- ``koi:cluster``, ``koi:job``, ``koi:rank`` (the rank id), ``koi:pool`` (the koi pool id), ``koi:env``
  (the rank's environment id: with these, Prometheus' EC2 discovery can label the engines' series);
- ``koi:key``: the idempotency key of the call that created the instance (a launch or a
  scale-up), ``koi:launch-key``: the rank's launch key (``Deployment.idempotency_key``);
- ``koi:replica``: the replica index; ``koi:replica-base`` + ``koi:nodes`` say the same from
  the creation tags alone (index = base + AmiLaunchIndex // nodes), for a process that died
  between ``run_instances`` and the ``create_tags`` that labels replicas;
- ``koi:replicas`` (the rank's target replica count) with ``koi:gen`` (bumped by each scale;
  the highest generation's target wins), ``koi:last-key`` (the last scale applied),
  ``koi:route-weight``, ``koi:reweight-key``, ``koi:teardown-key``;
- ``koi:rank-spec``: the rank (without ``n_replicas``/``route_weight``, which have their own
  tags) as compact JSON. EC2 caps a tag value at 256 characters and a full rank is ~440, so
  the JSON is split over ``koi:rank-spec``, ``koi:rank-spec:1``, ... (EC2 allows 50 tags).

Idempotency is the cloud's too: a launch is DUPLICATE when an instance (in any state) already
carries its key, and ``run_instances`` gets a ``ClientToken`` derived from the key, so a retry
racing a lost response cannot start a second set. Repeated scale/teardown/reweight keys are
recognised from ``koi:last-key``/``koi:teardown-key``/``koi:reweight-key``; for terminated
instances that lasts as long as EC2 still lists them (about an hour). A FAILED launch leaves
nothing in the cloud, so repeating its key tries again (the ledger would answer DUPLICATE).

A teardown hands over and drains (:mod:`infra.drain`: a ``koi:drain`` record on the rank's instances,
moved on by :meth:`Ec2Fleet.sweep`), unless ``drain_s`` is 0 without a handover: then it terminates at once.
A scale-in drains the replicas it removes (``koi:replica-drain-until``), released by the same sweep.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from botocore.exceptions import ClientError

from infra import backstop
from infra.engine import EngineError, EngineSpec, Node, script_for
from infra.replicas import Check, RankReads, ReplicaGroups
from koi.domain import Market, Pool, Rank, ResourceMap
from koi.logging import get_logger

#: Deep Learning Base OSS Nvidia Driver GPU AMI, resolved by EC2 in whichever region it launches.
DEFAULT_IMAGE = ("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
                 "base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id")

T_CLUSTER, T_JOB, T_RANK, T_POOL = "koi:cluster", "koi:job", "koi:rank", "koi:pool"
T_ENV = "koi:env"
T_KEY, T_LAUNCH_KEY, T_LAST_KEY = "koi:key", "koi:launch-key", "koi:last-key"
T_REPLICA, T_BASE, T_NODES = "koi:replica", "koi:replica-base", "koi:nodes"
T_REPLICAS, T_GEN, T_SPEC = "koi:replicas", "koi:gen", "koi:rank-spec"
T_WEIGHT, T_REWEIGHT, T_TEARDOWN = "koi:route-weight", "koi:reweight-key", "koi:teardown-key"
T_DRAIN, T_RDRAIN, T_RELEASE = "koi:drain", "koi:replica-drain-until", "koi:release-by"
T_MODEL, T_HEAD = "koi:model", "koi:head"

TAG_MAX = 256
#: States in which an instance still holds a place in its pool.
OCCUPYING = ("pending", "running", "shutting-down", "stopping", "stopped")
#: States in which an instance belongs to a deployment (not on its way out).
PRESENT = ("pending", "running", "stopping", "stopped")
UP = ("pending", "running")
_AZ_ID = re.compile(r"^[a-z]{2,}\d+-az\d+$")  # an AZ id (use1-az1), not a name (us-east-1a)
_NO_ZONE = {"any", "*", ""}
_REGION = "koi:region"  # added to each instance dict _ranks() lists: where to act on it
_DOOMED = "koi:doomed"  # added to a spot instance EC2 has given its two-minute interruption notice
#: How long one answer of DescribeSpotInstanceRequests stands (s): every read of the fleet would ask otherwise.
SPOT_NOTICE_TTL_S = 10.0
_NOTICES: dict[tuple[str | None, str], tuple[float, frozenset[str]]] = {}
_NOTICES_LOCK = threading.Lock()


def tag_value(v: str) -> str:
    """A value safe to store and to filter on: EC2 caps tags at 256 chars and reads * and ? as wildcards."""
    if len(v) <= TAG_MAX and "*" not in v and "?" not in v:
        return v
    return "sha256:" + hashlib.sha256(v.encode()).hexdigest()


def client_token(cluster_id: str, key: str, part: str = "") -> str:
    """EC2's own idempotency token (≤ 64 ASCII characters) for one run_instances call."""
    return hashlib.sha256(f"{cluster_id}\n{key}\n{part}".encode()).hexdigest()


def spec_tags(rank: Rank) -> dict[str, str]:
    s = json.dumps(rank.model_dump(mode="json", exclude={"n_replicas", "route_weight"}, exclude_none=True),
                   separators=(",", ":"), sort_keys=True)
    return {T_SPEC if i == 0 else f"{T_SPEC}:{i}": s[o:o + TAG_MAX] for i, o in enumerate(range(0, len(s), TAG_MAX))}


def rank_from_tags(tags: Mapping[str, str]) -> Rank:
    parts, i = [], 0
    while (k := T_SPEC if i == 0 else f"{T_SPEC}:{i}") in tags:
        parts.append(tags[k])
        i += 1
    d = json.loads("".join(parts))
    d["n_replicas"] = int(tags[T_REPLICAS])
    if T_WEIGHT in tags:
        d["route_weight"] = float(tags[T_WEIGHT])
    return Rank.model_validate(d)




def _tags(inst: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


def _state(inst: Mapping[str, Any]) -> str:
    return inst["State"]["Name"]


def _replica(inst: Mapping[str, Any], tags: Mapping[str, str]) -> int:
    if T_REPLICA in tags:
        return int(tags[T_REPLICA])
    return int(tags[T_BASE]) + int(inst.get("AmiLaunchIndex", 0)) // int(tags[T_NODES])


class _Rank(ReplicaGroups[dict[str, Any]]):
    """One rank as EC2 lists it: its present instances grouped by replica (:mod:`infra.replicas`)."""

    def __init__(self, insts: list[dict[str, Any]]) -> None:
        self.insts = insts
        self.head = _tags(max(insts, key=lambda i: int(_tags(i).get(T_GEN, "0"))))
        super().__init__(insts, nodes=int(self.head[T_NODES]), replica_of=lambda i: _replica(i, _tags(i)),
                         up=lambda i: _state(i) in UP and not i.get(_DOOMED),
                         running=lambda i: _state(i) == "running")


class Ec2Fleet(RankReads):
    """Executor + Observer over EC2 for one Koi cluster; ``pools`` bound what it may use.

    ``telemetry`` is empty: EC2 knows instances, not requests; engine metrics come from the
    vLLM observer (``infra.vllm_metrics``). ``run_args`` are passed to every ``run_instances``
    (SubnetId, SecurityGroupIds, IamInstanceProfile, UserData that starts the engine, ...).
    """

    CLOUD, JOB_KEY, LAUNCH_KEY, DRAIN_KEY = "aws", T_JOB, T_LAUNCH_KEY, T_DRAIN
    POOL_KEY, KEY_KEY, LAST_KEY, GEN_KEY = T_POOL, T_KEY, T_LAST_KEY, T_GEN
    REPLICAS_KEY, RDRAIN_KEY, WEIGHT_KEY, MODEL_KEY = T_REPLICAS, T_RDRAIN, T_WEIGHT, T_MODEL
    TEARDOWN_KEY, RELEASE_KEY = T_TEARDOWN, T_RELEASE
    RANK_KEY, REPLICA_KEY = T_RANK, T_REPLICA

    def __init__(self, cluster_id: str, pools: ResourceMap, *, client_factory: Callable[[str], Any] | None = None,
                 image_id: str = DEFAULT_IMAGE, clock: Callable[[], float] = time.time,
                 run_args: Mapping[str, Any] | None = None, engine: EngineSpec | None = None,
                 engine_port: int = 8000) -> None:
        self.cluster_id = cluster_id
        self.engine, self.engine_port = engine, engine_port
        self.pools = pools
        self.image_id = image_id
        self.run_args = dict(run_args or {})
        self._clock = clock
        self._factory = client_factory or _default_client
        self._clients: dict[str, Any] = {}
        self._zones: dict[tuple[str, str], str] = {}
        self._log = get_logger(__name__, cluster=cluster_id)

    # ---- Observer -------------------------------------------------------------------------------
    def capacity(self) -> ResourceMap:
        return self._capacity(Counter(_tags(i).get(T_POOL) for i in self._describe_all({}, OCCUPYING)))

    def _present(self) -> list[dict[str, Any]]:
        """The cluster's instances not on their way out, each with its region."""
        return [{**i, _REGION: region} for region, insts in self._describe_by_region({}, PRESENT).items()
                for i in insts]

    def _ranks(self, present: list[dict[str, Any]] | None = None) -> dict[str, _Rank]:
        """This cluster's ranks as EC2 lists them (instances not on their way out, nor draining after a
        scale-in), by rank id."""
        by_rank: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for i in self._present() if present is None else present:
            if T_RANK in (t := _tags(i)) and T_RDRAIN not in t:
                by_rank[t[T_RANK]].append(i)
        return {rid: _Rank(insts) for rid, insts in sorted(by_rank.items())}

    @staticmethod
    def _rank_of(head: Mapping[str, str]) -> Rank:
        return rank_from_tags(head)

    @staticmethod
    def _head_addr(r: _Rank, k: int) -> str | None:
        """Replica ``k``'s head node — the instance with the lowest launch index, where vLLM's API server and its
        ``/metrics`` run — by private address (the engines serve inside the VPC), else the public one."""
        head = min(r.replicas[k], key=lambda i: int(i.get("AmiLaunchIndex", 0)))
        addr = head.get("PrivateIpAddress") or head.get("PublicIpAddress")
        return str(addr) if addr else None

    # ---- Executor -------------------------------------------------------------------------------
    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        tv = tag_value(idempotency_key)
        took = False
        for region, insts in self._describe_by_region({T_RANK: rank_id}, UP).items():
            mine = [i for i in insts if _tags(i).get(T_JOB) == job_id]
            if not any(_state(i) == "running" for i in mine) or any(_tags(i).get(T_REWEIGHT) == tv for i in mine):
                continue
            self._client(region).create_tags(Resources=[i["InstanceId"] for i in mine], Tags=_tag_list(
                {T_WEIGHT: repr(float(route_weight)), T_REWEIGHT: tv}))
            took = True
        if took:
            self._log.info("aws.reweight", job=job_id, rank=rank_id, route_weight=route_weight)
        return took

    # ---- EC2 ------------------------------------------------------------------------------------
    # the cloud's side of RankReads.launch, .scale, .teardown and .sweep
    def _unplaceable(self, pool: Pool) -> str | None:
        return f"pool {pool.pool_id} names no region to launch in" if pool.env.region in _NO_ZONE else None

    def _keyed(self, pool: Pool, stored: str) -> list[dict[str, Any]]:
        return self._describe(pool.env.region, {T_KEY: stored}, None)

    def _rank_in(self, pool: Pool, rank_id: str) -> list[dict[str, Any]]:
        return self._describe(pool.env.region, {T_RANK: rank_id}, None)

    def _replica_index(self, inst: Mapping[str, Any]) -> str:
        return str(_replica(inst, _tags(inst)))  # a node that died before its replica tag: from its launch index

    def _fleet_listing(self) -> list[Any]:
        return self._present()

    def _rank_listing(self, rank_id: str) -> list[dict[str, Any]]:
        return [{**i, _REGION: region} for region, insts in self._describe_by_region({T_RANK: rank_id}, None).items()
                for i in insts]

    def _meta(self, inst: Mapping[str, Any]) -> dict[str, str]:
        return _tags(inst)

    def _staying(self, inst: Mapping[str, Any]) -> bool:
        return _state(inst) in PRESENT

    def _groups(self, insts: list[dict[str, Any]]) -> _Rank:
        return _Rank(insts)

    def _ident(self, inst: Mapping[str, Any]) -> str:
        return inst["InstanceId"]

    def _stored(self, key: str) -> str:
        return tag_value(key)

    def _free_in(self, pool: Pool) -> int:
        return self._free(pool)

    @staticmethod
    def _ids_by_region(insts: list[dict[str, Any]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for i in insts:
            out[i[_REGION]].append(i["InstanceId"])
        return {region: sorted(ids) for region, ids in out.items()}

    def _release(self, insts: list[dict[str, Any]]) -> None:
        for region, ids in self._ids_by_region(insts).items():
            self._terminate(region, ids)

    def _mark(self, insts: list[dict[str, Any]], updates: Mapping[str, str]) -> None:
        for region, ids in self._ids_by_region(insts).items():  # none: no call (EC2 refuses empty Resources)
            self._client(region).create_tags(Resources=ids, Tags=_tag_list(updates))

    def _reason(self, e: Exception) -> str | None:
        return _aws_reason(e) if isinstance(e, ClientError) else str(e) if isinstance(e, EngineError) else None

    def _client(self, region: str) -> Any:
        if region not in self._clients:
            self._clients[region] = self._factory(region)
        return self._clients[region]

    @property
    def _regions(self) -> list[str]:
        return sorted({p.env.region for p in self.pools.pools if p.env.region not in _NO_ZONE})

    def _describe(self, region: str, tags: Mapping[str, str], states: Iterable[str] | None) -> list[dict[str, Any]]:
        filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in {T_CLUSTER: self.cluster_id, **tags}.items()]
        if states is not None:
            filters.append({"Name": "instance-state-name", "Values": list(states)})
        out: list[dict[str, Any]] = []
        for page in self._client(region).get_paginator("describe_instances").paginate(Filters=filters):
            for res in page["Reservations"]:
                out.extend(res["Instances"])
        doomed = self._interrupted(region) if any(i.get("InstanceLifecycle") == "spot" for i in out) else frozenset()
        return [{**i, _DOOMED: True} if i["InstanceId"] in doomed else i for i in out]

    def _interrupted(self, region: str) -> frozenset[str]:
        """The spot instances of ``region`` EC2 has given their two-minute interruption notice (their spot request
        ``marked-for-termination``): a replica with one is broken at once — its rank DEGRADED, out of the routes, and
        replaced by the next scale — rather than when the instance is gone. One call per region every
        :data:`SPOT_NOTICE_TTL_S`; an error is logged and read as no notice (the reclaim is then seen when it
        happens, as before)."""
        client = self._client(region)
        key, now = (client.meta.endpoint_url, region), time.monotonic()
        with _NOTICES_LOCK:
            if key in _NOTICES and now - _NOTICES[key][0] < SPOT_NOTICE_TTL_S:
                return _NOTICES[key][1]
        try:
            reqs = client.describe_spot_instance_requests(
                Filters=[{"Name": "status-code", "Values": ["marked-for-termination"]}])["SpotInstanceRequests"]
        except ClientError as e:
            self._log.warning("aws.spot_notices_unread", region=region, reason=_aws_reason(e))
            return frozenset()
        ids = frozenset(r["InstanceId"] for r in reqs if r.get("InstanceId"))
        if ids:
            self._log.info("aws.spot_interruption", region=region, instances=sorted(ids))
        with _NOTICES_LOCK:
            _NOTICES[key] = (now, ids)
        return ids

    def _describe_by_region(self, tags: Mapping[str, str],
                            states: Iterable[str] | None) -> dict[str, list[dict[str, Any]]]:
        return {region: self._describe(region, tags, states) for region in self._regions}

    def _describe_all(self, tags: Mapping[str, str], states: Iterable[str] | None) -> list[dict[str, Any]]:
        return [i for insts in self._describe_by_region(tags, states).values() for i in insts]

    def _free(self, pool: Pool) -> int:
        used = len(self._describe(pool.env.region, {T_POOL: pool.pool_id}, OCCUPYING))
        return max(0, pool.total_instances - used)

    def _terminate(self, region: str, ids: list[str]) -> None:
        if ids:
            self._client(region).terminate_instances(InstanceIds=ids)

    def _zone(self, pool: Pool) -> str | None:
        """The AZ name to place in; an AZ id (use1-az1) is resolved, since names differ per account."""
        zone, region = pool.env.zone, pool.env.region
        if zone in _NO_ZONE:
            return None
        if not _AZ_ID.match(zone):
            return zone
        if (region, zone) not in self._zones:
            azs = self._client(region).describe_availability_zones(ZoneIds=[zone])["AvailabilityZones"]
            self._zones[(region, zone)] = azs[0]["ZoneName"]
        return self._zones[(region, zone)]

    def _preflight_pool(self, pool: Pool) -> list[Check]:
        """A dry run of the launch Koi would send for one instance of the pool: EC2 checks the permissions (tagging
        at launch included), the image, the instance type, the subnet and the zone, and launches nothing."""
        rank = self._probe_rank(pool)
        args, _ = self._launch_args(pool, "koi-preflight", rank.rank_id("koi-preflight"), rank, key="koi-preflight",
                                    launch_key="koi-preflight", base=0, count=1, target=1, gen=1, weight=None)
        what = f"pool {pool.pool_id}: run_instances (dry run)"
        try:
            self._client(pool.env.region).run_instances(**args, DryRun=True)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "DryRunOperation":
                return [Check(what, True, "would launch")]
            return [Check(what, False, _aws_reason(e))]
        return [Check(what, False, "EC2 ignored DryRun")]  # pragma: no cover - EC2 always answers a dry run

    def _create_replicas(self, pool: Pool, job_id: str, rid: str, rank: Rank, *, key: str, launch_key: str, base: int,
             count: int, target: int, gen: int, weight: float | None, last_key: str | None = None,
             model: str | None = None) -> list[str]:
        """One all-or-nothing run_instances for ``count`` replicas (MinCount = MaxCount), then label replicas.
        With an engine spec, the user data starts vLLM as the rank asks (:mod:`infra.engine`)."""
        args, tags = self._launch_args(pool, job_id, rid, rank, key=key, launch_key=launch_key, base=base, count=count,
                                       target=target, gen=gen, weight=weight, last_key=last_key, model=model)
        nodes = self._nodes(rank, pool)
        client = self._client(pool.env.region)
        insts = client.run_instances(**args)["Instances"]
        replicas: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for i in insts:
            replicas[_replica(i, tags)].append(i)
        for r, group in sorted(replicas.items()):
            label = {T_REPLICA: str(r)}
            head = min(group, key=lambda i: int(i.get("AmiLaunchIndex", 0)))
            if nodes > 1 and head.get("PrivateIpAddress"):
                label[T_HEAD] = head["PrivateIpAddress"]
            client.create_tags(Resources=[i["InstanceId"] for i in group], Tags=_tag_list(label))
        return [i["InstanceId"] for i in insts]

    def _launch_args(self, pool: Pool, job_id: str, rid: str, rank: Rank, *, key: str, launch_key: str, base: int,
                     count: int, target: int, gen: int, weight: float | None, last_key: str | None = None,
                     model: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """The run_instances arguments of ``count`` replicas, and the tags they carry."""
        nodes = self._nodes(rank, pool)
        # one request starts every node: a node finds its index and (Koi tags it below) its head from the metadata
        node = Node(index=f"$(( $(koi_imds meta-data/ami-launch-index) % {nodes} ))" if nodes > 1 else "0",
                    count=nodes, gpus=pool.gpus_per_instance, head="$(koi_imds_wait meta-data/tags/instance/koi:head)",
                    imds=True)
        watch = None if self.engine is None else backstop.watchdog("aws", self.engine.log_file)
        script = script_for(self.engine, self.engine_port, self.cluster_id, job_id, rid, model, rank, node, watch)
        tags = {T_CLUSTER: self.cluster_id, T_JOB: job_id, T_RANK: rid, T_POOL: pool.pool_id,
                T_ENV: rank.env.env_id[:TAG_MAX],
                T_KEY: tag_value(key), T_LAUNCH_KEY: tag_value(launch_key), T_BASE: str(base), T_NODES: str(nodes),
                T_REPLICAS: str(target), T_GEN: str(gen), "Name": f"koi/{self.cluster_id}/{rid}"[:TAG_MAX],
                **spec_tags(rank)}
        if weight is not None:
            tags[T_WEIGHT] = repr(float(weight))
        if last_key is not None:
            tags[T_LAST_KEY] = last_key
        if model is not None:
            tags[T_MODEL] = model
        args: dict[str, Any] = {
            **self.run_args, "ImageId": self.image_id, "InstanceType": pool.instance_type,
            "MinCount": count * nodes, "MaxCount": count * nodes, "ClientToken": client_token(self.cluster_id, key),
            "TagSpecifications": [{"ResourceType": "instance", "Tags": _tag_list(tags)}],
        }
        if (zone := self._zone(pool)) is not None:
            args["Placement"] = {"AvailabilityZone": zone}
        if pool.env.market is Market.SPOT:
            args["InstanceMarketOptions"] = {"MarketType": "spot"}
        if script is not None:
            args["UserData"] = script  # boto3 base64-encodes it
        # Koi's script (or the operator's, with `koi fleet backstop-script` in it) reads koi:head and koi:release-by
        # from the instance metadata, and the backstop's shutdown terminates (infra/backstop.py): an instance Koi
        # never restarts has no use stopped
        args["MetadataOptions"] = {**dict(self.run_args.get("MetadataOptions") or {}), "InstanceMetadataTags": "enabled"}
        args["InstanceInitiatedShutdownBehavior"] = "terminate"
        return args, tags



def _tag_list(tags: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def _aws_reason(e: ClientError) -> str:
    err = e.response.get("Error", {})
    return f"{err.get('Code', 'ClientError')}: {err.get('Message', str(e))}"


#: botocore's "standard" retries (throttling and transient errors, with backoff) and bounded waits: a tick's
#: activity retries on top, so a call never hangs a worker thread
_EC2_CONFIG = {"retries": {"mode": "standard", "total_max_attempts": 6}, "connect_timeout": 10, "read_timeout": 60}
_CLIENTS: dict[tuple[str | None, str, tuple[tuple[str, Any], ...]], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_SESSION: list[Any] = []


def ec2_client_factory(endpoint_url: str | None = None, **client_kw: Any) -> Callable[[str], Any]:
    """``region -> boto3 EC2 client``; credentials from the usual AWS chain unless given.

    One client per (endpoint, region, arguments) in the process, made under a lock from one session: boto3's clients
    are thread-safe, its sessions are not, and the worker makes fleets from several threads at once (the tick
    activities, the drain sweep, the gateway, the file-SD publisher) — a concurrent ``boto3.client`` on the default
    session can fail. Sharing also saves the 0.1–0.2 s a new EC2 client costs."""

    def make(region: str) -> Any:
        key = (endpoint_url, region, tuple(sorted(client_kw.items())))
        with _CLIENTS_LOCK:
            if key not in _CLIENTS:
                import boto3
                from botocore.config import Config

                if not _SESSION:
                    _SESSION.append(boto3.session.Session())
                _CLIENTS[key] = _SESSION[0].client("ec2", region_name=region, endpoint_url=endpoint_url,
                                                   config=Config(**_EC2_CONFIG), **client_kw)
            return _CLIENTS[key]

    return make


def _default_client(region: str) -> Any:
    return ec2_client_factory()(region)
