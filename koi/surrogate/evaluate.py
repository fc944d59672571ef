"""``koi surrogate eval``: the surrogate against measured silicon, the simulator, and the paper's example.

This is a benchmark, not a test. Three parts, each next to the plain roofline anchor
(:mod:`koi.surrogate.roofline`):

1. **Silicon** (:func:`silicon_eval`): aiconfigurator-core's measured dense H100/H200 rows,
   through koi.perf's row loader, in the surrogate's closed-loop mode. Reported per split
   (koi.perf fits its engine overheads on the Qwen3 rows; the Llama rows are held out) and
   for four surrogate variants: the operator model + replay alone; the same rescaled by the
   model's **own measured profile** on that GPU and engine, built from its other
   configurations only (leave-one-configuration-out); rescaled by the **nearest profiled
   architecture** (leave-one-model-out: each row's own model is removed from the profile
   book, so every row is predicted by the spec's missing-profile rule); and the analytic
   closed-loop queueing approximation.
2. **Simulator grid** (:func:`sim_eval`): ≥ 200 single-replica online deployments over every
   catalog GPU type, several models, three workload shapes and three loads, served by
   koi.sim's World. The world of this benchmark declares a few hidden per-environment effects
   (:data:`GRID_HIDDEN`) — the kind of deviation from the operator tables the paper's
   surrogate must learn — which the surrogate never reads: it sees telemetry only. Errors
   before learning, and after learning from ``n_learn`` observed deployments (PerfDB records
   built from their telemetry and per-request records), on the deployments not learned from.
3. **The paper's A10G example** (:func:`a10g_example`): Llama-3-70B on 8 A10G-class GPUs,
   2,048/512 tokens: every TP/PP layout and instance shape, feasibility, throughput and
   $/token, ranked, with the spreads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from koi import catalog
from koi.domain import Chain, ChainConfig, Environment, Job, Rank
from koi.logging import get_logger
from koi.surrogate import roofline
from koi.surrogate.core import Surrogate

log = get_logger(__name__)

Progress = Callable[[str, int, int], None] | None


def _pct(x: np.ndarray, q: float) -> float | None:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    return float(np.percentile(x, q)) if len(x) else None


def _ape(pred: np.ndarray, obs: np.ndarray) -> np.ndarray:
    pred, obs = np.asarray(pred, float), np.asarray(obs, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.abs(pred - obs) / np.abs(obs) * 100.0


def _fig(err: np.ndarray) -> dict[str, float | None]:
    return {"median_pct": _pct(err, 50), "p90_pct": _pct(err, 90), "n": int(np.isfinite(err).sum())}


# ================================================================== 1. silicon
def silicon_eval(*, limit: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Median and p90 absolute % error of mean TTFT and TPOT on the dense H100/H200 silicon rows."""
    from koi.surrogate import silicon

    df = silicon.rows()
    if limit is not None and limit < len(df):
        df = df.sample(n=limit, random_state=seed).sort_index()
    t0 = time.perf_counter()
    base = silicon.own_profile_cv(silicon.predict_rows(df))
    book = _book_from(base)
    nearest = silicon.predict_rows(df, profiles=book, leave_model_out=True)
    analytic = silicon.predict_rows(df, method="analytic")
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {"rows": int(len(df)), "seconds": round(elapsed, 1), "splits": {}}
    for split in ("holdout", "fit", "all"):
        sel = (lambda d: d) if split == "all" else (lambda d, s=split: d[d["split"] == s])  # noqa: E731
        out["splits"][split] = {
            "surrogate_replay": silicon.summarise(sel(base), "sur"),
            "surrogate_own_profile_cv": silicon.summarise(sel(base), "own"),
            "surrogate_nearest_arch": silicon.summarise(sel(nearest), "sur"),
            "surrogate_analytic": silicon.summarise(sel(analytic), "sur"),
            "roofline": silicon.summarise(sel(base), "roof"),
        }
    out["by_backend"] = {
        b: {"surrogate_replay": silicon.summarise(base[base["backend"] == b], "sur"),
            "roofline": silicon.summarise(base[base["backend"] == b], "roof")}
        for b in sorted(base["backend"].unique())
    }  # fmt: skip
    out["nearest_arch_flags"] = sorted({f for fl in nearest["flags"] for f in str(fl).split(",") if f})
    out["reference"] = {"aiconfigurator_ttft_median_pct": 44.0, "aiconfigurator_tpot_median_pct": 10.0,
                        "target_median_pct": 20.0}  # fmt: skip
    return out


def _book_from(df):  # noqa: ANN001, ANN202 - a quick book from already-predicted rows (sampled runs)
    from koi.surrogate.profiles import ProfileBook

    ok = df[np.isfinite(df["sur_ttft_ms"]) & np.isfinite(df["sur_tpot_ms"])]
    return ProfileBook.from_ratios(
        (r.model, r.gpu, r.backend, r.ttft_ms / r.sur_ttft_ms, r.tpot_ms / r.sur_tpot_ms, "silicon")
        for r in ok.itertuples()
    )


# ================================================================== 2. simulator grid
#: One instance shape per catalog GPU type (cloud, instance).
GRID_SHAPES: dict[str, tuple[str, str, str]] = {
    "A10G": ("aws", "us-east-1", "g5.12xlarge"),
    "L4": ("aws", "us-east-1", "g6.12xlarge"),
    "L40S": ("aws", "us-east-1", "g6e.12xlarge"),
    "A100-40GB": ("aws", "us-east-1", "p4d.24xlarge"),
    "A100-80GB": ("aws", "us-east-1", "p4de.24xlarge"),
    "H100": ("aws", "us-east-1", "p5.48xlarge"),
    "H200": ("aws", "us-east-1", "p5en.48xlarge"),
    "RTX-PRO-6000": ("gcp", "us-central1", "g4-standard-192"),
    "MI300X": ("azure", "eastus", "Standard_ND96isr_MI300X_v5"),
}
GRID_MODELS = ("llama-3.1-8b", "qwen3-8b", "mistral-7b", "phi-4", "qwen3-32b", "llama-3.1-70b", "mixtral-8x7b",
               "qwen3-30b-a3b")  # fmt: skip
GRID_WORKLOADS = {"chat": (1024, 256), "rag": (3072, 192), "code": (512, 768)}
GRID_LOADS = (0.3, 0.55, 0.8)  # up to the online utilisation cap a planner itself applies
#: The benchmark world's hidden effects (never read by the surrogate): per-environment
#: deviations of serving speed from the operator tables.
GRID_HIDDEN: list[dict[str, Any]] = [
    {"kind": "efficiency", "match": {"gpu_type": "A10G"}, "step_time_factor": 1.18,
     "note": "A10G borrows L40S tables; the real part is slower"},
    {"kind": "efficiency", "match": {"gpu_type": "MI300X"}, "step_time_factor": 1.25,
     "note": "ROCm kernels versus the H200 tables MI300X borrows"},
    {"kind": "efficiency", "match": {"gpu_type": "L4"}, "step_time_factor": 1.10, "note": "virtualization"},
    {"kind": "noisy_neighbours", "match": {"gpu_type": "H100"}, "step_time_factor": 1.08, "jitter_cv": 0.08,
     "note": "shared hosts"},
    {"kind": "interconnect", "match": {"gpu_type": "A100-40GB"}, "comm_factor": 1.6, "note": "degraded links"},
]  # fmt: skip


def probe_job(job_id: str, model: str, kind: str, isl: float, osl: float, arrival: dict[str, Any],
              spread: float = 0.3) -> Job:  # fmt: skip
    """An online job of a benchmark grid: lognormal lengths (CV ``spread``, clipped at 3× the mean) and
    SLO targets loose enough never to bind (the grids measure latency, they do not size against it)."""
    return Job(
        job_id=job_id,
        model=model,
        job_class="online",
        slo={"p99_ttft_ms": 60_000.0, "p99_tpot_ms": 2_000.0},
        workload={
            "kind": kind,
            "input_len": {"kind": "lognormal", "mean": isl, "std": isl * spread, "min": 16, "max": isl * 3},
            "output_len": {"kind": "lognormal", "mean": osl, "std": osl * spread, "min": 4, "max": osl * 3},
            "arrival": arrival,
        },
    )


def _grid_job(i: int, model: str, wl: str, rate: float) -> Job:
    isl, osl = GRID_WORKLOADS[wl]
    return probe_job(f"g{i:03d}", model, wl, isl, osl, {"process": "poisson", "rate_rps": rate})


def build_grid(n: int = 216, seed: int = 0) -> list[tuple[Job, Rank]]:
    """≥ n feasible single-replica deployments over every GPU type (deterministic for a seed).

    Each GPU type gets an equal share; within it, (model, tp, dtype, workload, load) are drawn
    from the feasible combinations. The offered rate is a load fraction of the *predicted*
    saturation (as a planner sizing a replica would choose it).
    """
    rng = np.random.default_rng(seed)
    s = Surrogate()
    per_gpu = math.ceil(n / len(GRID_SHAPES))
    out: list[tuple[Job, Rank]] = []
    for gpu, (cloud, region, inst) in GRID_SHAPES.items():
        env = Environment(cloud=cloud, region=region, zone=f"{region}-a", market="on_demand", gpu_type=gpu)
        gcount = catalog.instance(cloud, inst).gpu_count
        combos = []
        for model in GRID_MODELS:
            for tp in (1, 2, 4, 8):
                if tp > gcount:
                    continue
                for wd in ("bf16", "fp8"):
                    cfg = ChainConfig(tp=tp, weight_dtype=wd, instance_type=inst)
                    for wl in GRID_WORKLOADS:
                        combos.append((model, cfg, wl))
        rng.shuffle(combos)
        picked = 0
        seen: set[tuple] = set()
        for model, cfg, wl in combos:
            if picked >= per_gpu:
                break
            key = (model, cfg.tp, wl)
            if key in seen:  # spread over models and layouts before repeating one with another dtype
                continue
            load = GRID_LOADS[picked % len(GRID_LOADS)]
            probe = _grid_job(len(out), model, wl, 1.0)
            cap = s.rank_capacity(probe, Chain(env=env, config=cfg))
            if not cap.feasible or cap.saturation_rps <= 0:
                continue
            seen.add(key)
            rate = round(load * cap.saturation_rps, 4)
            job = _grid_job(len(out), model, wl, max(rate, 1e-3))
            out.append((job, Rank(env=env, config=cfg, n_replicas=1)))
            picked += 1
    return out


def _grid_scenario(grid: list[tuple[Job, Rank]], duration_s: float):  # noqa: ANN202 - a koi.sim Scenario
    from koi.sim.scenario import parse_scenario

    need: dict[tuple[str, str, str], int] = {}
    for _, r in grid:
        cloud, region, inst = GRID_SHAPES[r.env.gpu_type]
        per = catalog.instance(cloud, inst).gpu_count
        need[(cloud, region, inst)] = need.get((cloud, region, inst), 0) + max(1, math.ceil(r.config.gpus / per))
    pools = [
        {"name": f"{inst}", "cloud": cloud, "region": region, "zone": f"{region}-a", "market": "on_demand",
         "instance_type": inst, "instances": k}
        for (cloud, region, inst), k in need.items()
    ]  # fmt: skip
    return parse_scenario({"name": "surrogate-grid", "duration_s": duration_s, "seed": 11, "pools": pools,
                           "hidden": GRID_HIDDEN}, check_deployments=False)  # fmt: skip


def _observe(world, job: Job, rank_id: str, t0: float, t1: float) -> tuple[dict[str, float], dict[str, float], int]:  # noqa: ANN001
    """Observed V (telemetry means) and Y (p99s from the per-request records) of one rank in [t0, t1]."""
    from koi import variables

    wins = [w for w in world.telemetry(t0, t1) if w.rank_id == rank_id]
    obs_v: dict[str, float] = {}
    obs_y: dict[str, float] = {}
    n = 0
    if wins:
        w = wins[0]
        n = w.n_samples
        for k, xs in w.series.items():
            if xs:
                (obs_v if variables.kind_of(k).value == "V" else obs_y)[k] = float(np.mean(xs))
    rec = world.records()
    j = world.job_ids.index(job.job_id)
    r = rec[(rec["job"] == j) & (rec["arrival"] >= t0) & (rec["arrival"] < t1 - 60.0)]
    if len(r):
        ttft = np.where(np.isfinite(r["first_token"]), r["first_token"] - r["arrival"], t1 - r["arrival"])
        obs_y["p99_ttft_ms"] = float(np.percentile(ttft, 99) * 1e3)
        done = r[np.isfinite(r["finish"]) & (r["tokens_out"] > 1)]
        if len(done):
            tpot = (done["finish"] - done["first_token"]) / (done["tokens_out"] - 1)
            obs_y["p99_tpot_ms"] = float(np.percentile(tpot, 99) * 1e3)
    return obs_v, obs_y, n


def deploy_and_run(world, grid: list[tuple[Job, Rank]], key: str, until_s: float,  # noqa: ANN001 - a koi.sim World
                   progress: Progress = None) -> list[tuple[int, Job, Rank, Any, Any]]:  # fmt: skip
    """Submit and launch every (job, rank) of a grid in ``world``, predict each with the default
    surrogate, then run the world to ``until_s`` in 20 steps; (index, job, rank, launch result,
    prediction) of those that launched."""
    base = Surrogate()
    launched = []
    for i, (job, rank) in enumerate(grid):
        world.submit(job)
        res = world.launch(job, rank, f"{key}-{i}")
        if res.status.value != "launched":
            log.warning("grid_launch_failed", grid=key, job=job.job_id, reason=res.reason)
            continue
        launched.append((i, job, rank, res, base.predict_rank(job, rank)))
        if progress:
            progress("predict+launch", i + 1, len(grid))
    steps = 20
    for k in range(1, steps + 1):
        world.advance(until_s * k / steps)
        if progress:
            progress("simulate", k, steps)
    return launched


def run_grid(*, n_configs: int = 216, seed: int = 0, warm_s: float = 420.0, measure_s: float = 600.0,
             progress: Progress = None) -> list[dict[str, Any]]:  # fmt: skip
    """Deploy the grid in one simulated world; per deployment: job, rank, base prediction, observations."""
    from koi.sim.world import World

    grid = build_grid(n_configs, seed)
    scen = _grid_scenario(grid, warm_s + measure_s)
    world = World(scen, seed=seed)
    launched = deploy_and_run(world, grid, "grid", warm_s + measure_s, progress)
    t0, t1 = warm_s, warm_s + measure_s
    rows = []
    for _, job, rank, res, p in launched:
        ov, oy, n = _observe(world, job, res.rank_id, t0, t1)
        if "p99_ttft_ms" not in oy or "p99_tpot_ms" not in oy:
            continue
        rows.append({"job": job, "rank": rank, "pred": p, "obs_v": ov, "obs_y": oy, "n": n, "configs": len(grid),
                     "window": (t0, t1)})  # fmt: skip
    return rows


Y_KEYS = ("p99_ttft_ms", "p99_tpot_ms", "throughput_tokens_per_sec")
V_KEYS = ("kv_cache_util", "live_batch_size", "gpu_mem_used_fraction", "comm_overhead_pct")


def learning_eval(rows: list[dict[str, Any]], *, n_learn: int = 20, seed: int = 0) -> dict[str, Any]:
    """Errors on the deployments not learned from: base surrogate, after learning from ``n_learn``
    observed deployments (PerfDB records), and the roofline."""
    from koi.store import PerfRecord

    rng = np.random.default_rng(seed + 1)
    order = rng.permutation(len(rows))
    learn_ix, test_ix = order[:n_learn], order[n_learn:]
    records = [
        PerfRecord.of("grid", int(k), rows[i]["job"], rows[i]["rank"], observed_v=rows[i]["obs_v"],
                      observed_y=rows[i]["obs_y"], predicted=rows[i]["pred"].base_values, n_samples=rows[i]["n"])
        for k, i in enumerate(learn_ix)
    ]  # fmt: skip
    learned = Surrogate.from_records(records)
    after = [learned.predict_rank(rows[i]["job"], rows[i]["rank"]) for i in test_ix]
    before = [rows[i]["pred"] for i in test_ix]

    def errs(preds_: list, key: str) -> np.ndarray:
        src = "obs_y" if key in Y_KEYS else "obs_v"
        return np.array([_ape(p.values[key], rows[i][src].get(key, np.nan)) for p, i in zip(preds_, test_ix, strict=True)])

    fig: dict[str, Any] = {}
    for key in Y_KEYS + V_KEYS:
        fig[key] = {"before": _fig(errs(before, key)), "after": _fig(errs(after, key))}
    roof: dict[str, list[float]] = {k: [] for k in Y_KEYS}
    for i in test_ix:
        j, r = rows[i]["job"], rows[i]["rank"]
        m, g = catalog.model(j.model), catalog.gpu(r.env.gpu_type)
        rf = roofline.open_loop(m, g, r.config.tp, r.config.pp, j.workload.isl, j.workload.osl,
                                j.workload.arrival.rate_rps, dtype=r.config.weight_dtype)  # fmt: skip
        roof["p99_ttft_ms"].append(float(_ape(rf.ttft_ms, rows[i]["obs_y"]["p99_ttft_ms"])))
        roof["p99_tpot_ms"].append(float(_ape(rf.tpot_ms, rows[i]["obs_y"]["p99_tpot_ms"])))
        roof["throughput_tokens_per_sec"].append(
            float(_ape(rf.throughput_tps, rows[i]["obs_y"].get("throughput_tokens_per_sec", np.nan))))
    for k in Y_KEYS:
        fig[k]["roofline"] = _fig(np.array(roof[k], dtype=float))
    return {"learned_from": len(records), "evaluated_on": int(len(test_ix)), "errors": fig}


def sim_eval(*, n_configs: int = 216, n_learn: int = 20, seed: int = 0, warm_s: float = 420.0,
             measure_s: float = 600.0, progress: Progress = None) -> dict[str, Any]:  # fmt: skip
    """The surrogate against the simulator on a grid of deployments, before and after learning."""
    t_start = time.perf_counter()
    rows = run_grid(n_configs=n_configs, seed=seed, warm_s=warm_s, measure_s=measure_s, progress=progress)
    out = learning_eval(rows, n_learn=n_learn, seed=seed)
    return {
        "configs": rows[0]["configs"] if rows else 0,
        "observed": len(rows),
        **out,
        "gpu_types": sorted({r["rank"].env.gpu_type for r in rows}),
        "models": sorted({r["job"].model for r in rows}),
        "hidden_effects_of_the_world": [dict(h) for h in GRID_HIDDEN],
        "window_s": list(rows[0]["window"]) if rows else [],
        "flags_seen": sorted({f for r in rows for f in r["pred"].flags}),
        "seconds": round(time.perf_counter() - t_start, 1),
    }


# ================================================================== 3. the paper's A10G example
A10G_LAYOUTS: tuple[tuple[int, int, str], ...] = (
    (8, 1, "g5.48xlarge"),
    (4, 2, "g5.48xlarge"),
    (4, 2, "g5.12xlarge"),
    (2, 4, "g5.48xlarge"),
    (2, 4, "g5.12xlarge"),
    (1, 8, "g5.48xlarge"),
    (1, 8, "g5.12xlarge"),
    (1, 8, "g5.2xlarge"),
    (8, 1, "g5.12xlarge"),
)


def a10g_example(*, weight_dtype: str = "bf16", gpu_mem_util: float = 0.95, surrogate: Surrogate | None = None
                 ) -> dict[str, Any]:  # fmt: skip
    """Llama-3-70B on 8 A10G GPUs (2,048 in / 512 out), every layout: feasibility, tok/s, $/token."""
    s = surrogate or Surrogate()
    job = Job(
        job_id="paper-a10g",
        model="llama-3-70b",
        job_class="batch",
        slo={"deadline_s": 3600.0, "num_requests": 1000},
        workload={
            "input_len": {"kind": "fixed", "mean": 2048, "min": 2048, "max": 2048},
            "output_len": {"kind": "fixed", "mean": 512, "min": 512, "max": 512},
        },
    )
    env = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="A10G")
    chains = [
        Chain(env=env, config=ChainConfig(tp=tp, pp=pp, instance_type=inst, weight_dtype=weight_dtype,
                                          gpu_mem_util=gpu_mem_util))  # fmt: skip
        for tp, pp, inst in A10G_LAYOUTS
    ]
    b = s.predict_many(job, chains)
    rows = []
    for i, (tp, pp, inst) in enumerate(A10G_LAYOUTS):
        it = catalog.instance("aws", inst)
        nodes = max(1, 8 // it.gpu_count)
        thr = float(b.values["throughput_tokens_per_sec"][i]) if b.feasible[i] else None
        cpt = float(b.values["cost_per_token"][i]) if b.feasible[i] else None
        rf = roofline.open_loop(catalog.model("llama-3-70b"), catalog.gpu("A10G"), tp, pp, 2048, 512, 1e6,
                                dtype=chains[i].config.weight_dtype, gpu_mem_util=gpu_mem_util)  # fmt: skip
        rows.append({
            "layout": f"TP{tp}/PP{pp}",
            "instances": f"{nodes}x {inst}",
            "feasible": bool(b.feasible[i]),
            "tok_per_s": None if thr is None else round(thr, 1),
            "usd_per_mtok": None if cpt is None else round(cpt * 1e6, 2),
            "usd_per_hour": round(float(b.hourly_cost[i]), 3),
            "roofline_tok_per_s": round(float(rf.throughput_tps), 1) if b.feasible[i] else None,
            "kv_tokens": int(b.aux["batch_cap"][i]) if b.feasible[i] else None,
            "pipeline_bubble": None if thr is None else round(float(b.values["pipeline_bubble_fraction"][i]), 3),
            "comm_pct": None if thr is None else round(float(b.values["comm_overhead_pct"][i]), 1),
            "flags": ",".join(b.flags[i]),
            "why_not": "; ".join(b.reasons[i])[:160],
        })
    feas = [r for r in rows if r["feasible"]]
    feas.sort(key=lambda r: r["usd_per_mtok"])
    spread = {}
    if feas:
        t = [r["tok_per_s"] for r in feas]
        c = [r["usd_per_mtok"] for r in feas]
        spread = {"throughput_x": round(max(t) / max(min(t), 1e-9), 2), "cost_per_token_x": round(max(c) / max(min(c), 1e-9), 2)}
    rows.sort(key=lambda r: (not r["feasible"], r["usd_per_mtok"] or 0))
    for k, r in enumerate(rows):
        r["rank"] = k + 1 if r["feasible"] else None
    return {
        "weight_dtype": weight_dtype,
        "gpu_mem_util": gpu_mem_util,
        "rows": rows,
        "feasible_layouts": len(feas),
        "spread": spread,
        "paper": {"feasible_layouts": 5, "throughput_x": 4.4, "cost_per_token_x": 7.5,
                  "TP4/PP2 2x g5.12xlarge": "180 tok/s, $0.97", "TP8/PP1 1x g5.48xlarge": "162 tok/s, $2.16"},
    }  # fmt: skip


def speed(n_target: int = 5000, *, repeats: int = 3) -> dict[str, Any]:
    """Candidate predictions per second of the batch API (cold: first call with the surrogate's caches
    empty; warm: repeated calls, as the planner scores the same chains again within and across ticks)."""
    job = _grid_job(0, "llama-3.1-8b", "chat", 10.0).model_copy(
        update={"slo": _grid_job(0, "llama-3.1-8b", "chat", 10.0).slo.model_copy(update={"p99_ttft_ms": 1000.0,
                                                                                           "p99_tpot_ms": 50.0})}
    )  # a realistic online SLO: some chains miss it at the cap and need the capacity search
    chains = []
    for inst in catalog.instances().values():
        for p in inst.prices:
            for market in ("on_demand", "spot"):
                if market == "spot" and p.spot_hourly is None:
                    continue
                env = Environment(cloud=inst.cloud, region=p.region, zone=f"{p.region}-a", market=market,
                                  gpu_type=inst.gpu_type)  # fmt: skip
                for tp, pp in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (1, 2)):
                    if tp * pp > inst.gpu_count:
                        continue
                    for wd in ("bf16", "fp8"):
                        for seqs in (128, 256):
                            chains.append(Chain(env=env, config=ChainConfig(tp=tp, pp=pp, weight_dtype=wd,
                                                max_num_seqs=seqs, instance_type=inst.name)))  # fmt: skip
    chains = (chains * math.ceil(n_target / len(chains)))[:n_target]
    from koi.surrogate.core import clear_caches

    clear_caches()  # cold = the surrogate's own caches empty (koi.perf's loaded operator tables stay)
    s = Surrogate()
    t = time.perf_counter()
    first = s.predict_many(job, chains)
    cold = time.perf_counter() - t
    searched = sum(1 for i in range(len(chains)) if first.feasible[i] and first.capacity_rps[i] < 0.8 * first.saturation_rps[i] - 1e-9)
    warm, nocap = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        s.predict_many(job, chains)
        warm.append(time.perf_counter() - t)
        t = time.perf_counter()
        s.predict_many(job, chains, with_capacity=False)
        nocap.append(time.perf_counter() - t)
    n = len(chains)
    return {
        "candidates": n,
        "distinct_chains": len(set(chains)),
        "cold_per_s": round(n / cold),
        "warm_per_s": round(n / min(warm)),
        "warm_no_capacity_per_s": round(n / min(nocap)),
        "warm_seconds": round(min(warm), 3),
        "capacity_searched": searched,
    }
