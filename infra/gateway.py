"""The gateway of a real fleet: the traffic split Koi plans, applied by nginx (or read by any gateway from JSON).

On a real fleet Koi's executors keep each rank's planned weight (``Rank.route_weight``) on its instances (EC2 tags,
GCE metadata); nothing sent traffic by it. :class:`GatewaySync` reads the fleet — its ranks and the head node of
each ready replica — every ``every_s`` and at once after a tick launched, scaled, reweighted or tore down, builds a
:class:`RouteTable` and, when it changed, writes it for the gateway:

- ``routes-<cluster>.json``: the table itself, for a gateway of the operator's own (a router, an Envoy control plane);
- with ``kind: nginx``: ``koi-<cluster>-upstreams.conf`` (``http`` context: one ``upstream`` per job, a
  ``server host:port weight=w`` per ready replica) and ``koi-<cluster>-locations.conf`` (``server`` context:
  ``location /<job_id>/`` proxies to the job's upstream with the prefix stripped, so a job's clients call
  ``http://gateway/<job_id>/v1/chat/completions``), then runs ``reload_command`` (default ``nginx -s reload``:
  a graceful reload — old workers finish the requests they hold).

Choices (the spec's gateway is the simulator's router, :mod:`koi.sim.routing`; a real one must split as it does):

1. **Weights by the simulator's rule** (:func:`koi.domain.routing.gateway_weights`): a replica's capacity is its
   rank's ``route_weight`` when every serving rank of the job carries one, else 1 (the simulator's fallback is
   the nominal decode capacity, which needs the performance model; the executors always store the planner's
   weight when it gave one). nginx's smooth weighted round-robin then sends exactly those shares per cycle.
2. **Only ready replicas' head nodes serve**, of live ranks and of ranks handing over to their replacement
   (:mod:`infra.drain`); a draining rank, a launching replica or a worker node of a multi-node replica gets
   no traffic. A job with no ready replica answers 503 with ``Retry-After`` (the simulator's requests wait at the
   gateway; a client of a real gateway retries).
3. **Write only on change, atomically**, and reload only then: a sync that finds the same table does nothing, so
   the periodic sync costs the cloud's list calls and no reloads. A failing reload is raised (the sync logs it)
   and tried again at every sync until nginx takes the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from koi.domain import Rank
from koi.domain.common import KoiModel
from koi.domain.routing import gateway_weights
from koi.logging import get_logger

log = get_logger(__name__)


class Backend(KoiModel):
    rank_id: str
    address: str = Field(description="host:port of a ready replica's head node (vLLM's OpenAI server)")
    weight: int = Field(ge=1)


class RouteTable(KoiModel):
    cluster_id: str
    jobs: dict[str, list[Backend]] = Field(default_factory=dict, description="job -> its ready replicas, sorted")


class GatewaySpec(KoiModel):
    """The fleet file's ``gateway:`` section."""

    kind: Literal["json", "nginx"] = "json"
    directory: str = Field(min_length=1, description="where Koi writes the routes (nginx: the conf.d it includes)")
    reload_command: list[str] = Field(default_factory=lambda: ["nginx", "-s", "reload"],
                                      description="nginx: run after the files changed")
    every_s: float = Field(default=15.0, gt=0, description="the periodic sync's period")


def route_table(cluster_id: str, routes: Sequence[tuple[str, Rank, Sequence[str]]], port: int) -> RouteTable:
    """Each job's ready replicas and their weights (choices 1 and 2). ``routes``: the fleet's ``(job, rank, head
    hosts of ready replicas)`` of the ranks it routes to (live or handing over, :mod:`infra.drain`)."""
    by_job: dict[str, list[tuple[str, str, Rank]]] = defaultdict(list)
    for job, rank, hosts in routes:
        by_job[job].extend((rank.rank_id(job), h, rank) for h in hosts)
    jobs: dict[str, list[Backend]] = {}
    for job, reps in sorted(by_job.items()):
        reps.sort(key=lambda x: (x[0], x[1]))
        planned = all(r.route_weight is not None for _, _, r in reps)
        caps = [float(r.route_weight or 1.0) if planned else 1.0 for _, _, r in reps]
        jobs[job] = [Backend(rank_id=rid, address=f"{h}:{port}", weight=w)
                     for (rid, h, _), w in zip(reps, gateway_weights(caps), strict=True)]
    return RouteTable(cluster_id=cluster_id, jobs=jobs)


def upstream_name(cluster_id: str, job_id: str) -> str:
    return "koi_" + hashlib.sha256(f"{cluster_id}\0{job_id}".encode()).hexdigest()[:16]


def nginx_conf(table: RouteTable, jobs: Sequence[str] = ()) -> tuple[str, str]:
    """(upstreams for the ``http`` context, locations for a ``server`` context). ``jobs``: jobs to answer 503 for
    while none of their replicas is ready (choice 2)."""
    head = f"# written by Koi for cluster {table.cluster_id}; do not edit (infra/gateway.py)\n"
    ups, locs = [head], [head]
    for job, backends in table.jobs.items():
        name = upstream_name(table.cluster_id, job)
        ups.append(f"upstream {name} {{  # job {job}\n")
        ups += [f"    server {b.address} weight={b.weight};  # {b.rank_id}\n" for b in backends]
        ups.append("    keepalive 32;\n}\n")
        locs.append(f"location /{job}/ {{\n    proxy_pass http://{name}/;\n    proxy_http_version 1.1;\n"
                    f"    proxy_set_header Connection \"\";\n    proxy_buffering off;\n"
                    f"    proxy_read_timeout 3600s;\n}}\n")
    for job in sorted(set(jobs) - set(table.jobs)):
        locs.append(f"location /{job}/ {{\n    add_header Retry-After 15 always;\n    return 503;\n}}\n")
    return "".join(ups), "".join(locs)


def _write(path: Path, text: str) -> bool:
    """Replace ``path`` with ``text`` atomically; False when it already holds it."""
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


class GatewaySync:
    """Builds the route table from a fleet and writes it for the gateway (module docstring). ``fleet``: an
    executor with ``deployments()`` and ``routes()`` (:class:`infra.aws.Ec2Fleet`, :class:`infra.gcp.GceFleet`)."""

    def __init__(self, spec: GatewaySpec, cluster_id: str, fleet: Any, port: int) -> None:
        self.spec, self.cluster_id, self.fleet, self.port = spec, cluster_id, fleet, port
        self.dir = Path(spec.directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.reloads = 0
        self._reload_due = False  # the files changed but nginx has not taken them (a reload failed)

    def sync(self) -> bool:
        """Read the fleet, write what changed, reload nginx if its files changed (or a reload is still due); True
        when anything was written or reloaded."""
        deps = self.fleet.deployments()
        table = route_table(self.cluster_id, self.fleet.routes(), self.port)
        changed = _write(self.dir / f"routes-{self.cluster_id}.json",
                         json.dumps(table.model_dump(mode="json"), indent=1, sort_keys=True) + "\n")
        if self.spec.kind == "nginx":
            ups, locs = nginx_conf(table, [d.job_id for d in deps])
            conf = [_write(self.dir / f"koi-{self.cluster_id}-upstreams.conf", ups),
                    _write(self.dir / f"koi-{self.cluster_id}-locations.conf", locs)]
            if any(conf) or self._reload_due:
                self._reload_due = True
                done = subprocess.run(self.spec.reload_command, capture_output=True, text=True, timeout=60)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(self.spec.reload_command)} exited {done.returncode}: "
                                       f"{(done.stderr or done.stdout).strip()[:300]}")
                self._reload_due = False
                self.reloads += 1
                changed = True
            changed = changed or any(conf)
        if changed:
            log.info("gateway.synced", cluster=self.cluster_id, jobs=len(table.jobs),
                     backends=sum(len(b) for b in table.jobs.values()), kind=self.spec.kind)
        return changed
