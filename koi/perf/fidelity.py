"""Fidelity of the step model against measured end-to-end latencies (``silicon_sample.csv``).

The rows: aggregated (not disaggregated) serving of dense Llama-3.1-8B, Llama-3.1-70B and
Qwen3-32B on H100-SXM and H200-SXM, pp = 1, with a known TP size and concurrency — every
such row in aiconfigurator-core's file (778; 772 replayable, 6 need more KV than our memory
model grants). Each row is replayed as the closed-loop benchmark of
:mod:`koi.perf.replay` with the row's backend tables and the engine's default knobs
(:func:`engine_default_config`); precision ``fp8`` means fp8 weights (the row's GEMM quant
mode: per-tensor ``fp8`` or block-scaled ``fp8_block``) and fp8 KV cache; no precision
means bf16 throughout.

**Held-out split.** The per-engine overheads of :mod:`koi.perf.overheads` are fitted on a
third of the rows and validated on the other two thirds: a row is a fit row when the
SHA-256 of its id, read as a fraction, is below 1/3 — a deterministic split stratified by
nothing, so every (model, GPU, engine, harness) group lands on both sides. The figure to
quote is the ``holdout`` split. (The first split tried, fitting on the Qwen3-32B family and
validating on Llama-3.1, mostly measures the difference between the benchmark harnesses
that produced the two families' rows: 37% median TTFT error (15% TPOT) on the Llama rows;
``split="family"`` reproduces it.)

The emulated benchmark (:mod:`koi.perf.replay`) has two harness choices: 10 requests per
client (the common ``num_prompts = 10 × concurrency``, fixed a priori) and a ±10% spread of
output lengths, chosen on the fit rows (median TTFT error there: fixed lengths ~38%, ±10%
~27%, ±25% ~28%).

The fit is linear in the constants because a closed-loop schedule does not depend on time:
each row's mean TTFT and TPOT are ``base + Σ_k c_k · F_k`` with per-iteration features
(1, sequences) plus a per-request TTFT constant, so fitting is a small non-negative robust
least squares on log-ratios of TTFT and TPOT (``scipy.optimize.least_squares``, soft-L1).

Reproduce: ``.venv/bin/python benchmarks/perf_step_bench.py --fidelity`` (or
``fidelity_report()``); refit with ``--fit`` (rewrites ``koi/perf/data/engine_overheads.yaml``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from datetime import date
from functools import cache
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from koi.domain import ChainConfig, DType, GpuSpec, ModelArch
from koi.logging import get_logger
from koi.perf.aic import package_version, silicon_csv
from koi.perf.overheads import EngineOverheads, clear_cache
from koi.perf.replay import DEFAULT_OSL_SPREAD, DEFAULT_ROUNDS, replay_schedule
from koi.perf.step import StepModel, step_model

log = get_logger(__name__)

MODEL_PATHS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "nvidia/Llama-3.1-8B-Instruct-FP8": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b",
    "Qwen/Qwen3-32B": "qwen3-32b",
}
SYSTEM_GPU = {"h100_sxm": "H100", "h200_sxm": "H200"}
FIT_FAMILY = "qwen3"  # split="family": rows of this family fit, the rest validate
FIT_FRACTION = 1.0 / 3.0  # split="hash": share of rows that fit
FEATURES = ("per_step_s", "per_seq_s", "per_prefill_layer_s", "per_prefill_token_s", "request_s")
FIT_FEATURES = ("per_step_s", "per_seq_s", "request_s")


def _sglang_mem_fraction(tp: int) -> float:
    """SGLang's default ``mem_fraction_static`` by TP size (server_args defaults)."""
    if tp >= 16:
        return 0.79
    if tp >= 8:
        return 0.81
    if tp >= 4:
        return 0.85
    if tp >= 2:
        return 0.87
    return 0.88


def engine_default_config(
    engine: str, gpu: GpuSpec, *, tp: int = 1, pp: int = 1, weight_dtype: DType | str = DType.BF16,
    kv_dtype: DType | str | None = None, version: str | None = None,
) -> ChainConfig:  # fmt: skip
    """A :class:`ChainConfig` with the engine's own default knobs, as a benchmark would run it.

    - vLLM (V1, OpenAI server): ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024 on
      GPUs with ≥ 70 GB, else 2048 and 256; ``gpu_memory_utilization`` 0.9; chunked prefill.
    - SGLang: ``chunked_prefill_size`` 8192; ``mem_fraction_static`` by TP size
      (0.88/0.87/0.85/0.81/0.79 for tp 1/2/4/8/16).
    - TRT-LLM: ``max_num_tokens`` 8192, ``max_batch_size`` 2048,
      ``kv_cache_free_gpu_mem_fraction`` 0.9.
    """
    big = gpu.memory_gb >= 70
    if engine == "vllm":
        budget, seqs, util = (8192, 1024, 0.9) if big else (2048, 256, 0.9)
    elif engine == "sglang":
        budget, seqs, util = 8192, 4096, _sglang_mem_fraction(tp)
    elif engine == "trtllm":
        budget, seqs, util = 8192, 2048, 0.9
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return ChainConfig(
        tp=tp, pp=pp, engine_name=engine, engine_version=version or "latest", max_num_batched_tokens=budget,
        max_num_seqs=seqs, gpu_mem_util=util, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
    )  # fmt: skip


# ---- the rows ----------------------------------------------------------------------------------------
@cache
def _silicon() -> pd.DataFrame:
    return pd.read_csv(silicon_csv())


def silicon_rows() -> pd.DataFrame:
    """The dense H100/H200 aggregated rows with the fields the replay needs."""
    df = _silicon()
    df = df[df["model_path"].isin(MODEL_PATHS) & df["system"].isin(SYSTEM_GPU) & (df["mode"] == "agg")]
    df = df[df["tp_size"].notna() & df["batch_size"].notna() & (df["pp_size"].fillna(1) == 1)]
    df = df[df["silicon_ttft_ms"].gt(0) & df["silicon_tpot_ms"].gt(0)]
    out = pd.DataFrame(
        {
            "id": df["id"],
            "model": df["model_path"].map(MODEL_PATHS),
            "system": df["system"],
            "gpu": df["system"].map(SYSTEM_GPU),
            "backend": df["backend"],
            "version": df["backend_version"].astype(object).where(df["backend_version"].notna(), None),
            "precision": df["precision"].fillna("bf16"),
            "gemm_quant": df["gemm_quant_mode"].fillna("bfloat16"),
            "tp": df["tp_size"].astype(int),
            "isl": df["isl"].astype(int),
            "osl": df["osl"].astype(int),
            "concurrency": df["batch_size"].astype(int),
            "ttft_ms": df["silicon_ttft_ms"].astype(float),
            "tpot_ms": df["silicon_tpot_ms"].astype(float),
        }
    )
    out["family"] = np.where(out["model"].str.startswith("qwen3"), "qwen3", "llama3")
    out = out.reset_index(drop=True)
    return assign_split(out, "hash")


def _id_fraction(s: str) -> float:
    return int(hashlib.sha256(s.encode()).hexdigest()[:12], 16) / float(16**12)


def assign_split(rows: pd.DataFrame, scheme: str = "hash") -> pd.DataFrame:
    """Label rows ``fit``/``holdout``: by id hash (a third fit) or by model family (Qwen3 fits)."""
    out = rows.copy()
    if scheme == "hash":
        out["split"] = np.where(out["id"].map(_id_fraction) < FIT_FRACTION, "fit", "holdout")
    elif scheme == "family":
        out["split"] = np.where(out["family"] == FIT_FAMILY, "fit", "holdout")
    else:
        raise ValueError(f"unknown split scheme {scheme!r}; expected 'hash' or 'family'")
    return out


def _row_setup(row) -> tuple[ModelArch, GpuSpec, ChainConfig, str]:
    from koi.catalog import gpu as catalog_gpu
    from koi.catalog import model as catalog_model

    m = catalog_model(row.model)
    g = catalog_gpu(row.gpu)
    fp8 = str(row.precision).lower() == "fp8"
    cfg = engine_default_config(
        row.backend, g, tp=int(row.tp), weight_dtype=DType.FP8 if fp8 else DType.BF16,
        kv_dtype=DType.FP8 if fp8 else DType.BF16, version=row.version,
    )  # fmt: skip
    mode = str(row.gemm_quant) if fp8 else "bfloat16"
    if mode not in ("fp8", "fp8_block"):
        mode = "fp8" if fp8 else "bfloat16"
    return m, g, cfg, mode


# ---- one row, linear in the overhead constants ---------------------------------------------------
@dataclass
class RowLinear:
    """Mean TTFT and TPOT of a row as ``base + F · c`` (seconds) for overhead constants ``c``."""

    ttft_base: float
    ttft_f: np.ndarray
    tpot_base: float
    tpot_f: np.ndarray
    iterations: int
    preemptions: int
    kv_tokens: int

    def predict(self, c: np.ndarray) -> tuple[float, float]:
        return self.ttft_base + float(self.ttft_f @ c), self.tpot_base + float(self.tpot_f @ c)


def row_linear(
    row, *, rounds: int | None = DEFAULT_ROUNDS, osl_spread: float = DEFAULT_OSL_SPREAD
) -> RowLinear:
    """Replay one silicon row once; its mean TTFT and TPOT as linear functions of the overheads."""
    m, g, cfg, mode = _row_setup(row)
    sm: StepModel = step_model(m, g, cfg, gemm_mode=mode)
    sched, w, n, cap = replay_schedule(
        m, g, cfg, int(row.isl), int(row.osl), int(row.concurrency), rounds=rounds, osl_spread=osl_spread
    )
    base = sm.step_time(sched.prefill_tokens, sched.prefill_ctx_sum, sched.decode_seqs, sched.decode_ctx_sum,
                        sched.prefill_seqs, overheads=EngineOverheads())  # fmt: skip
    f4 = sched.features()
    layers = float(sm.layout.max_stage_layers)
    # columns in FEATURES order: step, seq, prefill-layer, prefill-token, request
    feats = np.column_stack([f4[:, 0], f4[:, 1], f4[:, 2] * layers, f4[:, 3], np.zeros(len(f4))])
    cum_base = np.concatenate([[0.0], np.cumsum(base)])
    cum_f = np.vstack([np.zeros((1, feats.shape[1])), np.cumsum(feats, axis=0)])
    a = sched.arrival_iter + 1  # index into the cumulative sums (0 = time zero)
    f = sched.first_iter + 1
    e = sched.end_iter + 1
    ttft_f = cum_f[f] - cum_f[a]
    ttft_f[:, 4] = 1.0  # request_s: once per request, outside the engine
    d = np.maximum(sched.osl - 1, 1).astype(float)
    tpot_b = (cum_base[e] - cum_base[f]) / d
    tpot_f = (cum_f[e] - cum_f[f]) / d[:, None]
    return RowLinear(
        float(w @ (cum_base[f] - cum_base[a])), w @ ttft_f, float(w @ tpot_b), w @ tpot_f,
        sched.iterations, sched.preemptions, cap,
    )  # fmt: skip


# ---- the report ------------------------------------------------------------------------------------
@dataclass
class FidelityReport:
    rows: pd.DataFrame  # one line per silicon row: measured, predicted, abs % errors
    summary: dict[str, dict[str, float]]  # split -> {n, ttft_median, ttft_p90, tpot_median, tpot_p90}
    fitted: dict[str, dict] = field(default_factory=dict)  # refit constants, when asked

    def figures(self, split: str = "all") -> dict[str, float]:
        return self.summary[split]


def _summarise(df: pd.DataFrame) -> dict[str, float]:
    if df.empty:
        return {"n": 0}
    return {
        "n": int(len(df)),
        "ttft_median": float(np.median(df["ttft_err_pct"])),
        "ttft_p90": float(np.percentile(df["ttft_err_pct"], 90)),
        "tpot_median": float(np.median(df["tpot_err_pct"])),
        "tpot_p90": float(np.percentile(df["tpot_err_pct"], 90)),
    }


def _overhead_vector(backend: str, table: dict[str, EngineOverheads] | None) -> np.ndarray:
    from koi.perf.overheads import engine_overheads

    o = (table or {}).get(backend) or engine_overheads(backend)
    return np.array([getattr(o, k) for k in FEATURES])


def _row_linear_safe(row) -> RowLinear | str:
    try:
        return row_linear(row)
    except Exception as exc:  # an infeasible row is reported, not fatal
        return f"{type(exc).__name__}: {exc}"


def replay_rows(rows: pd.DataFrame, *, workers: int = 1) -> dict[str, RowLinear | str]:
    """:func:`row_linear` of every row (or the error that row raised), by row id."""
    items = [SimpleNamespace(**r) for r in rows.to_dict("records")]  # picklable for worker processes
    if workers > 1 and len(items) > 8:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_row_linear_safe, items, chunksize=8))
    else:
        results = [_row_linear_safe(r) for r in items]
    return {r.id: res for r, res in zip(items, results, strict=True)}


def fidelity_report(
    rows: pd.DataFrame | None = None,
    *,
    split: str = "hash",
    overheads: dict[str, EngineOverheads] | None = None,
    refit: bool = False,
    limit: int | None = None,
    seed: int = 0,
    workers: int = 1,
) -> FidelityReport:
    """Replay the silicon rows; median and p90 absolute % error of mean TTFT and TPOT per split.

    ``overheads`` overrides the stored per-engine constants; ``refit`` fits them afresh on the
    ``fit`` rows of ``split`` first (``report.fitted``); ``limit`` replays a deterministic random
    sample of that many rows (quick checks); ``workers`` > 1 replays in processes.
    """
    df = assign_split(silicon_rows() if rows is None else rows, split)
    if limit is not None and limit < len(df):
        df = df.sample(n=limit, random_state=seed).sort_index()
    lins = replay_rows(df, workers=workers)
    fitted: dict[str, dict] = {}
    if refit:
        ok_lins = {k: v for k, v in lins.items() if not isinstance(v, str)}
        fitted = fit_overheads(df[df["id"].isin(ok_lins)], lins=ok_lins)
        overheads = {
            e: EngineOverheads(**{k: v for k, v in d.items() if not k.startswith("_")})
            for e, d in fitted.items()
        }
    out = []
    for row in df.itertuples(index=False):
        lin = lins[row.id]
        if isinstance(lin, str):
            log.warning("fidelity_row_failed", id=row.id, error=lin)
            out.append({**row._asdict(), "pred_ttft_ms": math.nan, "pred_tpot_ms": math.nan, "error": lin})
            continue
        ttft, tpot = lin.predict(_overhead_vector(row.backend, overheads))
        out.append(
            {
                **row._asdict(),
                "pred_ttft_ms": ttft * 1e3,
                "pred_tpot_ms": tpot * 1e3,
                "iterations": lin.iterations,
                "preemptions": lin.preemptions,
                "kv_tokens": lin.kv_tokens,
                "error": "",
            }
        )
    res = pd.DataFrame(out)
    res["ttft_err_pct"] = (res["pred_ttft_ms"] - res["ttft_ms"]).abs() / res["ttft_ms"] * 100
    res["tpot_err_pct"] = (res["pred_tpot_ms"] - res["tpot_ms"]).abs() / res["tpot_ms"] * 100
    ok = res[res["error"] == ""]
    summary = {"all": _summarise(ok)}
    for sp in ("fit", "holdout"):
        summary[sp] = _summarise(ok[ok["split"] == sp])
    summary["holdout:vllm+trtllm"] = _summarise(
        ok[(ok["split"] == "holdout") & ok["backend"].isin(["vllm", "trtllm"])]
    )
    for backend in sorted(ok["backend"].unique()):
        summary[f"backend:{backend}"] = _summarise(ok[ok["backend"] == backend])
    summary["failed"] = {"n": int((res["error"] != "").sum())}
    return FidelityReport(rows=res, summary=summary, fitted=fitted)


def fidelity_summary(**kwargs) -> dict[str, dict[str, float]]:
    """Just the figures of :func:`fidelity_report` (what ``koi sim fidelity`` prints)."""
    return fidelity_report(**kwargs).summary


# ---- fitting the overheads ---------------------------------------------------------------------------
def fit_overheads(
    rows: pd.DataFrame | None = None, *, features: tuple[str, ...] = FIT_FEATURES, lins: dict | None = None
) -> dict[str, dict]:
    """Fit per-engine overheads on the rows labelled ``fit``; returns {engine: {constant: value, _stats}}."""
    from scipy.optimize import least_squares

    df = silicon_rows() if rows is None else rows
    fit = df[df["split"] == "fit"]
    idx = [FEATURES.index(f) for f in features]
    result: dict[str, dict] = {}
    for backend, sub in fit.groupby("backend"):
        ls, meas = [], []
        for row in sub.itertuples(index=False):
            lin = (lins or {}).get(row.id)
            if lin is None:
                try:
                    lin = row_linear(row)
                except Exception as exc:  # an infeasible row cannot inform the fit
                    log.warning("fit_row_failed", id=row.id, error=str(exc))
                    continue
            ls.append(lin)
            meas.append((row.ttft_ms / 1e3, row.tpot_ms / 1e3))
        if not ls:
            continue
        tb = np.array([r.ttft_base for r in ls])
        tf = np.array([r.ttft_f[idx] for r in ls])
        pb = np.array([r.tpot_base for r in ls])
        pf = np.array([r.tpot_f[idx] for r in ls])
        mt = np.array([m[0] for m in meas])
        mp = np.array([m[1] for m in meas])

        def resid(c: np.ndarray, tb=tb, tf=tf, mt=mt, pb=pb, pf=pf, mp=mp) -> np.ndarray:
            return np.concatenate([np.log((tb + tf @ c) / mt), np.log((pb + pf @ c) / mp)])

        x0 = np.array([{"per_step_s": 1e-3, "request_s": 2e-2}.get(f, 1e-5) for f in features])
        sol = least_squares(resid, x0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.1, x_scale=x0)
        r = resid(sol.x)
        n = len(ls)
        result[str(backend)] = {
            **{f: float(v) for f, v in zip(features, sol.x, strict=True)},
            "_rows": n,
            "_ttft_median_pct": float(np.median(np.abs(np.expm1(r[:n]))) * 100),
            "_tpot_median_pct": float(np.median(np.abs(np.expm1(r[n:]))) * 100),
        }
    return result


def write_overheads(fitted: dict[str, dict], path: Path | None = None) -> Path:
    """Store fitted constants with their provenance as ``koi/perf/data/engine_overheads.yaml``."""
    import yaml

    target = path or Path(str(resources.files("koi.perf").joinpath("data"))) / "engine_overheads.yaml"
    engines = {e: {k: v for k, v in d.items() if not k.startswith("_")} for e, d in fitted.items()}
    fit_stats = {e: {k[1:]: v for k, v in d.items() if k.startswith("_")} for e, d in fitted.items()}
    doc = {
        "provenance": {
            "fitted_on": str(date.today()),
            "data": f"aiconfigurator-core {package_version()} systems/silicon_sample.csv",
            "split": "fit = the dense H100/H200 aggregated silicon rows whose sha256(id) as a fraction is "
            "below 1/3 (Llama-3.1-8B/70B and Qwen3-32B, all three engines); the other two thirds are held "
            "out and give the validation figure",
            "features": list(FIT_FEATURES),
            "objective": "robust (soft-L1) least squares on log(predicted/measured) of mean TTFT and TPOT, "
            "constants >= 0",
            "by": "koi.perf.fidelity.fit_overheads",
            "fit_stats": fit_stats,
        },
        "engines": engines,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    header = (
        "# Engine overheads per iteration (seconds), FITTED by koi.perf.fidelity.fit_overheads on a held-out\n"
        "# split of aiconfigurator-core's measured silicon_sample.csv. Do not edit by hand; refit with\n"
        "#   .venv/bin/python benchmarks/perf_step_bench.py --fit\n"
    )
    target.write_text(header + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    clear_cache()
    return target
