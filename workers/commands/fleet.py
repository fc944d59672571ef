"""``koi fleet``: what a real fleet (EC2, Compute Engine, Azure) holds for a cluster, read from the cloud.

``koi fleet show --fleet fleet.yaml --cluster koi-prod`` checks the fleet file, reaches the cloud with the
credentials the workers will use, and lists each pool's budget and what the cluster's instances occupy, then each rank Koi runs
there (job, replicas ready of the target, state, its share of the job's traffic in the route table Koi writes for
the gateway — a draining rank still routed is handing over), and where S1's telemetry comes from (with Prometheus: how many of
each rank's engines it scrapes). Nothing is changed. It is the dry run an operator wants before
``koi worker --world aws|gcp`` and the first place to look when a tick says a launch was refused.

``koi fleet check`` asks the cloud, before the first tick, what the ticks will ask of it (the credentials, each pool's
launch as a dry run on EC2, the image and the machine types on Compute Engine and Azure), launching nothing.

``koi fleet gateway --fleet fleet.yaml --cluster koi-prod`` runs the gateway sync (:mod:`infra.gateway`) by itself,
on the host nginx runs on: the route table comes from the cloud (the instances' tags and metadata), not from a worker,
so the reload is local and the routes keep following the fleet while no worker runs. The workers' fleet file then
leaves ``gateway:`` out.
"""

from __future__ import annotations

import typer

from koi.cli.output import console, emit, fail, print_json
from koi.logging import get_logger

# the options every command shares (typer reads each default as the option's declaration)
FLEET = typer.Option(None, help="the fleet file (default KOI_FLEET_FILE)")
CLUSTER = typer.Option(None, help="cluster id (default KOI_CLUSTER_ID)")
CLOUD = typer.Option(None, help="aws, gcp or azure (default KOI_WORLD when it names one, else aws)")

app = typer.Typer(help="A real fleet as the cloud holds it (infra/cloud.py).", no_args_is_help=True)


def _open(fleet: str | None, cluster: str | None, cloud: str | None):  # noqa: ANN202 - (spec, cluster, cloud, fleet)
    """The fleet file, the cluster id, the cloud and its fleet, each from the option or the settings; a clear exit 2
    for a missing or bad file or an unknown cloud."""
    from infra.cloud import FleetError, load_fleet, make_fleet
    from koi.config import get_settings

    s = get_settings()
    path = fleet or s.fleet_file
    if not path:
        fail("no fleet file: --fleet PATH or KOI_FLEET_FILE")
    try:
        spec = load_fleet(path)
        cluster_id = cluster or s.cluster_id
        cloud = cloud or (s.world if s.world != "sim" else "aws")
        return spec, cluster_id, cloud, make_fleet(spec, cluster_id, cloud)  # type: ignore[arg-type]
    except FleetError as exc:
        fail(str(exc))
        raise  # not reached: fail exits


@app.command("show")
def show(
    fleet: str | None = FLEET,
    cluster: str | None = CLUSTER,
    cloud: str | None = CLOUD,
    json_out: bool = typer.Option(False, "--json", help="print one JSON document"),
    probe: bool = typer.Option(False, "--probe", help="count a replica ready once its engine answers health_path "
                                                      "(run where the engines are reachable); else once it runs"),
) -> None:
    """Pools (budget, used, free) and the cluster's ranks, read from the cloud; changes nothing."""
    from infra.cloud import engine_health
    from infra.gateway import route_table

    spec, cluster_id, cloud, fleet_ = _open(fleet, cluster, cloud)
    if probe:
        fleet_.health = engine_health(spec, cluster_id)
    try:
        free = {p.pool_id: p.free_instances for p in fleet_.capacity().pools}
        deps = fleet_.deployments()
        table = route_table(cluster_id, fleet_.routes(), spec.metrics_port)
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


@app.command("check")
def check(
    fleet: str | None = FLEET,
    cluster: str | None = CLUSTER,
    cloud: str | None = CLOUD,
    json_out: bool = typer.Option(False, "--json", help="print one JSON document"),
) -> None:
    """Before the first tick: ask the cloud what the ticks will ask of it, launching nothing — the credentials and
    the listing; EC2: each pool's launch as a dry run (permissions, image, type, subnet, zone); Compute Engine and
    Azure: the image, and each pool's machine type / VM size offered in its zone (with its GPUs); then this host:
    Prometheus answering, the file-discovery and gateway directories writable, nginx's reload command. Exit 1 when
    any check fails."""
    from infra.preflight import host_checks

    spec, cluster_id, cloud, fleet_ = _open(fleet, cluster, cloud)
    checks = fleet_.preflight() + host_checks(spec)
    rows = [{"check": c.what, "ok": c.ok, "detail": c.detail} for c in checks]
    if json_out:
        print_json({"cluster": cluster_id, "cloud": cloud, "ok": all(c.ok for c in checks), "checks": rows})
    else:
        emit([{**r, "ok": "ok" if r["ok"] else "FAILED"} for r in rows], False,
             title=f"{cloud} for cluster {cluster_id}: {sum(c.ok for c in checks)} of {len(checks)} checks pass")
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@app.command("gateway")
def gateway(
    fleet: str | None = typer.Option(None, help="the fleet file, with a gateway: section (default KOI_FLEET_FILE)"),
    cluster: str | None = CLUSTER,
    cloud: str | None = CLOUD,
    once: bool = typer.Option(False, "--once", help="sync once and exit (a cron job, a check)"),
) -> None:
    """Keep the gateway's routes (and nginx) in step with the fleet, read from the cloud, every gateway.every_s
    until interrupted. A sync that fails (the cloud, a reload nginx refuses) is logged and tried again; with
    --once it exits 1."""
    import threading

    from infra.cloud import engine_health
    from infra.gateway import GatewaySync

    spec, cluster_id, cloud, fleet_ = _open(fleet, cluster, cloud)
    if spec.gateway is None:
        fail(f"{fleet or 'the fleet file'} has no gateway: section (kind, directory, reload_command)")
    fleet_.health = engine_health(spec, cluster_id)  # nginx's host reaches the engines: route only to those that answer
    sync = GatewaySync(spec.gateway, cluster_id, fleet_, spec.metrics_port)
    log = get_logger(__name__, cluster=cluster_id)
    stop = threading.Event()
    log.info("gateway.agent", cloud=cloud, kind=spec.gateway.kind, directory=spec.gateway.directory,
             every_s=spec.gateway.every_s, once=once)
    try:
        while True:
            try:
                sync.sync()
            except Exception as exc:  # noqa: BLE001 - the cloud SDK's or the reload's errors: logged, tried again
                log.warning("gateway.sync_failed", error=f"{type(exc).__name__}: {exc}")
                if once:
                    raise typer.Exit(1) from exc
            if once:
                console.print(f"routes of cluster {cluster_id}: {sync.dir / f'routes-{cluster_id}.json'}"
                              + (f"; nginx reloaded {sync.reloads}x" if sync.reloads else ""))
                return
            stop.wait(spec.gateway.every_s)
    except KeyboardInterrupt:
        log.info("gateway.agent_stopped")


@app.command("backstop-script")
def backstop_script(
    cloud: str | None = CLOUD,
    identity: str | None = typer.Option(None, help="azure: the managed identity's resource id (default: the fleet "
                                                   "file's azure.identity)"),
    fleet: str | None = typer.Option(None, help="a fleet file to take azure.identity from"),
    log_file: str = typer.Option("/var/log/koi-engine.log", help="where the watchdog says what it did"),
) -> None:
    """Print the release backstop's watchdog (infra/backstop.py) as a boot script, for images or user data of your
    own (with engine: in the fleet file Koi's start-up script already runs it)."""
    from infra.backstop import standalone
    from infra.cloud import FleetError, load_fleet
    from koi.config import get_settings

    s = get_settings()
    cloud = cloud or (s.world if s.world != "sim" else "aws")
    if cloud not in ("aws", "gcp", "azure"):
        fail(f"unknown cloud {cloud!r}: aws, gcp or azure")
    if cloud == "azure" and identity is None and fleet:
        try:
            spec = load_fleet(fleet)
        except FleetError as exc:
            fail(str(exc))
        identity = spec.azure.identity if spec.azure else None
    text = standalone(cloud, log_file, identity)  # type: ignore[arg-type]
    if text is None:
        fail("azure: a VM can only release itself with a managed identity (--identity or azure.identity in the "
             "fleet file); a guest shutdown does not stop Azure's bill")
    typer.echo(text, nl=False)


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
