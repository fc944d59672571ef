"""``koi surrogate eval|predict|feasible|speed``: the surrogate S(x, e, W) → (V̂, Ŷ)."""

from __future__ import annotations

from typing import Any

import typer

from koi.cli.output import console, emit, err_console

app = typer.Typer(help="The surrogate: predictions, feasibility (C2), and its evaluation.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")


def _progress(enabled: bool):  # noqa: ANN202 - a callback or None
    if not enabled:
        return None
    from rich.progress import BarColumn, Progress, TextColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    console=err_console, transient=True)  # fmt: skip
    prog.start()
    tasks: dict[str, Any] = {}

    def cb(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = prog.add_task(stage, total=total)
        prog.update(tasks[stage], completed=done)
        if stage == "simulate" and done >= total:
            prog.stop()

    return cb


def _fmt_err(d: dict[str, Any]) -> str:
    if not d or d.get("median_pct") is None:
        return "-"
    return f"{d['median_pct']:.1f} / {d['p90_pct']:.1f}"


#: The arrival grids of :mod:`koi.surrogate.arrival_eval` (its ``GRIDS``), each a ``--part``.
ARRIVAL_GRIDS = ("arrivals", "arrivals-large")


@app.command("eval")
def eval_cmd(
    json_out: bool = JSON,
    part: list[str] = typer.Option(["silicon", "sim", "a10g"], "--part",
                                   help="silicon, sim, a10g, arrivals, arrivals-large (repeatable)"),
    configs: int = typer.Option(216, help="simulator grid size (≥ 200 deployments)"),
    learn: int = typer.Option(20, help="deployments the learned surrogate observes"),
    seed: int = typer.Option(0, help="grid and world seed"),
    silicon_limit: int | None = typer.Option(None, help="replay only a sample of the silicon rows"),
) -> None:
    """Benchmark the surrogate beside a plain roofline: silicon rows, the simulator grid, the paper's A10G case."""
    from koi.surrogate import evaluate

    out: dict[str, Any] = {}
    if "silicon" in part:
        out["silicon"] = evaluate.silicon_eval(limit=silicon_limit, seed=seed)
    if "sim" in part:
        out["sim"] = evaluate.sim_eval(n_configs=configs, n_learn=learn, seed=seed, progress=_progress(not json_out))
    for grid in ARRIVAL_GRIDS:
        if grid in part:
            from koi.surrogate import arrival_eval

            out[grid] = arrival_eval.arrival_eval(seed=seed, progress=_progress(not json_out), grid=grid)
    if "a10g" in part:
        out["a10g"] = {
            "bf16": evaluate.a10g_example(weight_dtype="bf16", gpu_mem_util=0.95),
            "fp8": evaluate.a10g_example(weight_dtype="fp8", gpu_mem_util=0.90),
        }
    if json_out:
        emit(out, True)
        return
    if "silicon" in out:
        s = out["silicon"]
        rows = []
        for split, d in s["splits"].items():
            for who, f in d.items():
                rows.append({"split": split, "predictor": who, "n": f.get("n"),
                             "TTFT median/p90 %": _fmt_err({"median_pct": f.get("ttft_median_pct"), "p90_pct": f.get("ttft_p90_pct")}),
                             "TPOT median/p90 %": _fmt_err({"median_pct": f.get("tpot_median_pct"), "p90_pct": f.get("tpot_p90_pct")})})  # fmt: skip
        emit(rows, False, title=f"silicon_sample.csv dense H100/H200 rows ({s['rows']}), mean TTFT/TPOT abs % error "
                                "(aiconfigurator: ~44% / ~10%; target ≤ 20%)")  # fmt: skip
    if "sim" in out:
        s = out["sim"]
        rows = [{"quantity": k, "before learning": _fmt_err(v["before"]), f"after {s['learned_from']} deployments": _fmt_err(v["after"]),
                 "roofline": _fmt_err(v.get("roofline", {}))} for k, v in s["errors"].items()]  # fmt: skip
        emit(rows, False, title=f"simulator grid: {s['configs']} deployments over {len(s['gpu_types'])} GPU types, "
                                f"abs % error median / p90 on the {s['evaluated_on']} not learned from")  # fmt: skip
    for a in (out[g] for g in ARRIVAL_GRIDS if g in out):
        rows = [{"arrival": c["arrival"], "replicas": c["replicas"], "n": c["n"],
                 "p99 TTFT pred/obs median [p10, p90]": _fmt_ratio(c, "ttft"),
                 "p99 TPOT pred/obs median [p10, p90]": _fmt_ratio(c, "tpot")} for c in a["cells"]]  # fmt: skip
        o = a["overall"]
        emit(rows, False, title=f"{a['grid']}: {a['deployments']} deployments; median |log(pred/obs)| p99 TTFT "
                                f"{o['ttft_abs_log_ratio_median']}, p99 TPOT {o['tpot_abs_log_ratio_median']}")  # fmt: skip
    if "a10g" in out:
        for dt, a in out["a10g"].items():
            cols = ["rank", "layout", "instances", "feasible", "tok_per_s", "usd_per_mtok", "usd_per_hour", "roofline_tok_per_s",
                    "pipeline_bubble", "comm_pct", "why_not"]  # fmt: skip
            emit(a["rows"], False, columns=cols,
                 title=f"Llama-3-70B on 8 A10G, 2048/512, {dt} weights (gpu_mem_util {a['gpu_mem_util']}): "
                       f"{a['feasible_layouts']} feasible, spread {a['spread']} (paper: 5 layouts, 4.4x tok/s, 7.5x $/tok)")  # fmt: skip


def _fmt_ratio(c: dict[str, Any], key: str) -> str:
    if c.get(f"{key}_ratio_median") is None:
        return "-"
    return f"{c[f'{key}_ratio_median']:.2f} [{c[f'{key}_ratio_p10']:.2f}, {c[f'{key}_ratio_p90']:.2f}]"


@app.command()
def speed(json_out: bool = JSON, candidates: int = typer.Option(5000, help="candidate chains per call")) -> None:
    """Candidate predictions per second of the batch API (cold and warm)."""
    from koi.surrogate import evaluate

    emit(evaluate.speed(candidates), json_out, title="surrogate batch API speed")


@app.command()
def predict(
    model: str = typer.Argument(..., help="catalog model"),
    gpu: str = typer.Argument(..., help="catalog GPU type"),
    json_out: bool = JSON,
    tp: int = typer.Option(1),
    pp: int = typer.Option(1),
    replicas: int = typer.Option(1),
    instance: str | None = typer.Option(None, help="instance type (default: the smallest that holds the chain)"),
    cloud: str = typer.Option("aws"),
    region: str = typer.Option("us-east-1"),
    market: str = typer.Option("on_demand"),
    dtype: str = typer.Option("bf16", help="weight dtype"),
    isl: float = typer.Option(1024.0),
    osl: float = typer.Option(256.0),
    rate: float = typer.Option(2.0, help="requests/s offered to the rank"),
    ttft: float = typer.Option(2000.0, help="p99 TTFT target, ms"),
    tpot: float = typer.Option(100.0, help="p99 TPOT target, ms"),
) -> None:
    """Predict one rank (V and Y by registry name) for an online job."""
    from koi.domain import ChainConfig, Environment, Job, Rank
    from koi.surrogate import Surrogate

    job = Job(
        job_id="cli", model=model, job_class="online", slo={"p99_ttft_ms": ttft, "p99_tpot_ms": tpot},
        workload={"input_len": {"kind": "lognormal", "mean": isl, "std": isl * 0.3, "min": 1, "max": int(isl * 4)},
                  "output_len": {"kind": "lognormal", "mean": osl, "std": osl * 0.3, "min": 1, "max": int(osl * 4)},
                  "arrival": {"process": "poisson", "rate_rps": rate}},
    )  # fmt: skip
    env = Environment(cloud=cloud, region=region, zone=f"{region}-a", market=market, gpu_type=gpu)
    rank = Rank(env=env, config=ChainConfig(tp=tp, pp=pp, weight_dtype=dtype, instance_type=instance), n_replicas=replicas)
    p = Surrogate().predict_rank(job, rank, offered_rps=rate)
    if json_out:
        emit(p, True)
        return
    rows = [{"variable": k, "predicted": v} for k, v in p.values.items()]
    emit(rows, False, title=f"{model} on {replicas}x {gpu} tp{tp} pp{pp} at {rate} req/s")
    console.print(f"feasible={p.feasible} flags={p.flags} uncertainty={p.uncertainty:.2f} "
                  f"capacity={p.capacity_rps:.2f} req/s/replica saturation={p.saturation_rps:.2f} {'; '.join(p.reasons)}")  # fmt: skip


@app.command()
def feasible(
    model: str = typer.Argument(...),
    gpu: str = typer.Argument(...),
    json_out: bool = JSON,
    tp: int = typer.Option(1),
    pp: int = typer.Option(1),
    ep: int = typer.Option(1),
    instance: str | None = typer.Option(None),
    cloud: str = typer.Option("aws"),
    dtype: str = typer.Option("bf16"),
) -> None:
    """C2: can this chain run (VRAM, TP/heads, PP/layers, EP, instance shape)?"""
    from koi.domain import Chain, ChainConfig, Environment
    from koi.surrogate import check

    env = Environment(cloud=cloud, region="any", zone="any", market="on_demand", gpu_type=gpu)
    f = check(model, Chain(env=env, config=ChainConfig(tp=tp, pp=pp, ep=ep, weight_dtype=dtype, instance_type=instance)))
    data = {"ok": f.ok, "reasons": list(f.reasons), "flags": list(f.flags), "instance": f.instance.name if f.instance else None,
            "nodes": f.nodes, **({"memory": f.memory.summary()} if f.memory else {})}  # fmt: skip
    emit(data, json_out, title=f"{model} tp{tp} pp{pp} ep{ep} on {gpu}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="surrogate")
