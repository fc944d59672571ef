"""``koi catalog gpus|instances|models``: the shipped catalogs."""

from __future__ import annotations

import typer

from koi import catalog as cat
from koi.cli.output import emit

app = typer.Typer(help="Browse the shipped catalogs (GPUs, instance types and prices, model architectures).",
                  no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")


@app.command()
def gpus(json_out: bool = JSON) -> None:
    """GPU types with their data-sheet figures."""
    rows = [
        {
            "name": g.name,
            "vendor": g.vendor,
            "memory_gb": g.memory_gb,
            "mem_bw_gbs": g.mem_bw_gbs,
            "bf16_tflops": g.bf16_tflops,
            "fp8_tflops": g.fp8_tflops,
            "interconnect": g.interconnect.value,
            "intra_node_bw_gbs": g.intra_node_bw_gbs,
            "measured_tables": g.aic_system or "rescaled",
        }
        for g in cat.gpus().values()
    ]
    emit(rows if not json_out else [g.model_dump(mode="json") for g in cat.gpus().values()], json_out,
         title=f"{len(rows)} GPU types")


@app.command()
def instances(
    json_out: bool = JSON,
    cloud: str | None = typer.Option(None, help="only this cloud"),
    gpu: str | None = typer.Option(None, help="only this GPU type"),
) -> None:
    """Instance shapes with on-demand, spot and reserved $/hour per region."""
    items = [
        i for i in cat.instances().values()
        if (cloud is None or i.cloud == cloud.lower()) and (gpu is None or i.gpu_type == cat.canonical_gpu(gpu))
    ]
    if json_out:
        emit([i.model_dump(mode="json") for i in items], True)
        return
    rows = []
    for i in items:
        for p in i.prices:
            rows.append({
                "cloud": i.cloud, "instance": i.name, "gpu": i.gpu_type, "gpus": i.gpu_count,
                "interconnect": i.interconnect.value, "region": p.region,
                "on_demand_$/h": p.on_demand_hourly, "spot_$/h": p.spot_hourly,
                "reserved_$/h": i.hourly_price(p.region, "reserved"), "as_of": str(i.price_date),
            })
    clouds = sorted({i.cloud for i in items})
    emit(rows, False, title=f"{len(items)} instance types over {len(clouds)} providers ({', '.join(clouds)})")


@app.command()
def models(json_out: bool = JSON) -> None:
    """Model architectures from their published configs."""
    ms = list(cat.models().values())
    if json_out:
        emit([m.model_dump(mode="json") for m in ms], True)
        return
    rows = [
        {
            "name": m.name, "family": m.family, "params_b": m.params_b, "active_b": round(m.active_params_b, 1),
            "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "experts": f"{m.num_experts_active}/{m.num_experts}" if m.is_moe else "dense", "type": m.model_type,
        }
        for m in ms
    ]
    emit(rows, False, title=f"{len(ms)} models ({sum(m.is_moe for m in ms)} MoE)")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="catalog")
