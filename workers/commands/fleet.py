"""``koi fleet``: what a real fleet (EC2, Compute Engine, Azure) holds for a cluster, read from the cloud.

``koi fleet show --fleet fleet.yaml --cluster koi-prod`` checks the fleet file, reaches the cloud with the
credentials the workers will use, and lists each pool's budget and what the cluster's instances occupy, then each rank Koi runs
there (job, replicas ready of the target, state, its share of the job's traffic in the route table Koi writes for
the gateway — a draining rank still routed is handing over), and where S1's telemetry comes from (with Prometheus: how many of
each rank's engines it scrapes). Nothing is changed. It is the dry run an operator wants before
``koi worker --world aws|gcp`` and the first place to look when a tick says a launch was refused.
"""

from __future__ import annotations

import typer

from koi.cli.output import console, emit, fail, print_json

app = typer.Typer(help="A real fleet as the cloud holds it (infra/cloud.py).", no_args_is_help=True)


@app.command("show")
def show(
    fleet: str | None = typer.Option(None, help="the fleet file (default KOI_FLEET_FILE)"),
    cluster: str | None = typer.Option(None, help="cluster id (default KOI_CLUSTER_ID)"),
    cloud: str | None = typer.Option(None, help="aws, gcp or azure (default KOI_WORLD when it names one, else aws)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document"),
) -> None:
    """Pools (budget, used, free) and the cluster's ranks, read from the cloud; changes nothing."""
    from infra.cloud import FleetError, load_fleet, make_fleet
    from infra.gateway import route_table
    from koi.config import get_settings

    s = get_settings()
    path = fleet or s.fleet_file
    if not path:
        fail("no fleet file: --fleet PATH or KOI_FLEET_FILE")
        return
    try:
        spec = load_fleet(path)
    except FleetError as exc:
        fail(str(exc))
        return
    cluster_id = cluster or s.cluster_id
    cloud = cloud or (s.world if s.world != "sim" else "aws")
    try:
        fleet_ = make_fleet(spec, cluster_id, cloud)  # type: ignore[arg-type]
        free = {p.pool_id: p.free_instances for p in fleet_.capacity().pools}
        deps = fleet_.deployments()
        table = route_table(cluster_id, fleet_.routes(), spec.metrics_port)
    except FleetError as exc:
        fail(str(exc))
        return
    except Exception as exc:  # noqa: BLE001 - the cloud SDK's errors (credentials, network, API): report, exit 2
        fail(f"cannot read the fleet from {cloud}: {type(exc).__name__}: {exc}")
        return
    # usd_per_hour: what the cluster's instances in the pool cost at the file's price, draining ones included
    pools = [{"pool": p.pool_id, "instance_type": p.instance_type, "market": p.env.market.value,
              "budget": p.total_instances, "used": p.total_instances - free[p.pool_id], "free": free[p.pool_id],
              "usd_per_hour": round((p.total_instances - free[p.pool_id]) * p.hourly_price, 2)}
             for p in spec.pools]
    usd = round(sum(p["usd_per_hour"] for p in pools), 2)
    share = {(job, b.rank_id): 0.0 for job, bs in table.jobs.items() for b in bs}
    for job, bs in table.jobs.items():
        for b in bs:
            share[(job, b.rank_id)] += b.weight / sum(x.weight for x in bs)
    # routed: the rank's share of its job's traffic at the gateway; a "draining" rank still routed is handing over
    ranks = [{"job": d.job_id, "rank": d.rank_id, "env": d.rank.env.env_id,
              "instance_type": d.rank.config.instance_type, "replicas_ready": d.replicas_ready,
              "replicas": d.rank.n_replicas, "state": d.state.value,
              "routed": f"{100 * share[(d.job_id, d.rank_id)]:.0f}%" if (d.job_id, d.rank_id) in share else "-"}
             for d in deps]
    telemetry = _telemetry(spec, cluster_id, ranks)
    if json_out:
        print_json({"cluster": cluster_id, "pools": pools, "usd_per_hour": usd, "ranks": ranks,
                    "telemetry": telemetry, "routes": table.model_dump(mode="json")["jobs"]})
        return
    emit(pools, False, title=f"fleet of cluster {cluster_id}: pools (${usd:,.2f}/h in all)")
    if ranks:
        emit(ranks, False, title="ranks (routed: the rank's share of its job's traffic at the gateway)")
    else:
        console.print("no ranks: Koi runs nothing on this fleet for this cluster")
    console.print(f"telemetry: {telemetry['source']}" + (f" at {telemetry['url']}" if telemetry.get("url") else "")
                  + (f" — {telemetry['error']}" if telemetry.get("error") else ""))


def _telemetry(spec, cluster_id: str, ranks: list[dict]) -> dict:  # noqa: ANN001 - infra.cloud.FleetSpec
    """Where S1's samples come from; with Prometheus, whether it reaches it and how many of each rank's engines it
    scrapes (``engines_up`` is added to each rank row). Prometheus down is reported, not an exit."""
    if not spec.prometheus_url:
        return {"source": "worker scrape", "every_s": spec.scrape_every_s}
    from infra.prometheus import PrometheusTelemetry

    tel = PrometheusTelemetry(spec.prometheus_url, timeout_s=spec.prometheus_timeout_s)
    try:
        up = tel.engines_up(cluster_id)
    except Exception as exc:  # noqa: BLE001 - unreachable or a bad answer: say so, the cloud part still stands
        return {"source": "prometheus", "url": spec.prometheus_url, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        tel.close()
    for r in ranks:
        ok, n = up.get((r["job"], r["rank"]), (0, 0))
        r["engines_up"] = f"{ok}/{n}"
    unknown = sorted(f"{j}/{k}" for j, k in up if not any((r["job"], r["rank"]) == (j, k) for r in ranks))
    return {"source": "prometheus", "url": spec.prometheus_url, "ranks_scraped": len(up), "stale_ranks": unknown}


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="fleet")
