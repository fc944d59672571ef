"""The surrogate against measured silicon: aiconfigurator-core's ``silicon_sample.csv``.

Rows come from koi.perf's fidelity loader (:func:`koi.perf.fidelity.silicon_rows`: dense
Llama-3.1-8B/70B and Qwen3-32B, aggregated serving on H100/H200, pp = 1) and each row's chain
is the engine's default config (:func:`koi.perf.fidelity.engine_default_config`), exactly as
koi.perf's own replay harness sets them up. The workload is a fixed-concurrency closed loop,
so the surrogate runs in its closed-loop mode (:meth:`Surrogate.closed_loop`), under the
benchmark client that measured each row (its ``client`` column: aiconfigurator's genai-perf or
vLLM's benchmark_serving — the length spreads and the front end the latency was measured
through are part of the workload, not of the deployment).

The replay follows the benchmark protocol koi.perf's fidelity harness established for these
rows (all clients start at once; means over ten rounds, the initial burst included), so the
surrogate's closed-loop replay and ``koi.perf.fidelity`` agree row for row. koi.perf fits its
engine overheads on the Qwen3 rows ("fit" split); the Llama rows are held out. Figures are
reported per split; the held-out split is the honest one.

The same rows give the measured **profiles** of the nearest-architecture rule
(:mod:`koi.surrogate.profiles`): per (model, GPU), the geometric mean of measured/predicted
mean TTFT (prefill ratio) and TPOT (decode ratio), predicted with profiles switched off.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.common import DType
from koi.domain.hardware import Environment
from koi.logging import get_logger
from koi.surrogate import roofline
from koi.surrogate.profiles import ProfileBook

log = get_logger(__name__)


def _env(gpu: str) -> Environment:
    cloud = "aws"
    return Environment(cloud=cloud, region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type=gpu)


def rows() -> pd.DataFrame:
    from koi.perf.fidelity import silicon_rows

    return silicon_rows()


def predict_rows(df: pd.DataFrame, surrogate=None, *, profiles: ProfileBook | None = None,
                 leave_model_out: bool = False, method: str = "replay") -> pd.DataFrame:  # fmt: skip
    """Add ``sur_ttft_ms``/``sur_tpot_ms`` (surrogate) and ``roof_ttft_ms``/``roof_tpot_ms`` (roofline).

    ``profiles``: apply this book's speed ratios; with ``leave_model_out`` each row's own model
    is removed from the book first, so the row is predicted by the nearest-architecture rule.
    Without ``profiles`` the surrogate runs on the operator model alone.
    """
    from koi.perf.fidelity import engine_default_config
    from koi.surrogate.core import Surrogate

    out = df.copy()
    out["sur_ttft_ms"] = np.nan
    out["sur_tpot_ms"] = np.nan
    out["roof_ttft_ms"] = np.nan
    out["roof_tpot_ms"] = np.nan
    out["flags"] = ""
    if "client" not in out:
        out["client"] = None
    groups = out.groupby(["model", "gpu", "backend", "version", "precision", "tp", "isl", "osl", "client"],
                         dropna=False)  # fmt: skip
    surrogates: dict[str, Surrogate] = {}
    for (model, gpu, backend, version, precision, tp, isl, osl, client), sub in groups:
        g = catalog.gpu(gpu)
        arch = catalog.model(model)
        fp8 = str(precision).lower() == "fp8"
        wd = DType.FP8 if fp8 else DType.BF16
        cfg = engine_default_config(backend, g, tp=int(tp), weight_dtype=wd, kv_dtype=wd,
                                    version=None if version is None or version != version else str(version))  # fmt: skip
        key = model if leave_model_out else "_"
        if profiles is None:
            s = surrogate or Surrogate(profiles=None)
            use_profile = False
        else:
            if key not in surrogates:
                book = profiles.without_model(model) if leave_model_out else profiles
                surrogates[key] = Surrogate(profiles=book)
            s = surrogates[key]
            use_profile = True
        chain = Chain(env=_env(gpu), config=cfg)
        conc = sub["concurrency"].to_numpy(dtype=float)
        who = client if isinstance(client, str) else None
        r = s.closed_loop(arch, [chain] * len(sub), float(isl), float(osl), conc, profile=use_profile,
                          method=method, client=who)  # fmt: skip
        out.loc[sub.index, "sur_ttft_ms"] = r["ttft_ms"]
        out.loc[sub.index, "sur_tpot_ms"] = r["tpot_ms"]
        out.loc[sub.index, "flags"] = [",".join(f) for f in r["flags"]]
        rf = roofline.closed_loop(arch, g, int(tp), 1, float(isl), float(osl), conc, dtype=wd, kv_dtype=wd)
        out.loc[sub.index, "roof_ttft_ms"] = rf.ttft_ms
        out.loc[sub.index, "roof_tpot_ms"] = rf.tpot_ms
    for who in ("sur", "roof"):
        for m in ("ttft", "tpot"):
            out[f"{who}_{m}_err_pct"] = (out[f"{who}_{m}_ms"] - out[f"{m}_ms"]).abs() / out[f"{m}_ms"] * 100.0
    return out


def own_profile_cv(pred: pd.DataFrame) -> pd.DataFrame:
    """Each row rescaled by its *own* model's measured profile on that GPU and engine, built from the
    group's other configurations only (leave-one-configuration-out: a profile measured once, used
    for a TP/length/concurrency it was not measured at). Adds ``own_ttft_ms``/``own_tpot_ms``."""
    out = pred.copy()
    ok = np.isfinite(out["sur_ttft_ms"]) & np.isfinite(out["sur_tpot_ms"])
    cfg = out["tp"].astype(str) + "|" + out["isl"].astype(str) + "|" + out["osl"].astype(str)
    grp = out["model"] + "|" + out["gpu"] + "|" + out["backend"]
    out["own_ttft_ms"] = np.nan
    out["own_tpot_ms"] = np.nan
    for (g, c), sub in out[ok].groupby([grp[ok], cfg[ok]]):
        others = out[ok & (grp == g) & (cfg != c)]
        if others.empty:
            continue
        book = ProfileBook.from_ratios(
            (r.model, r.gpu, r.backend, r.ttft_ms / r.sur_ttft_ms, r.tpot_ms / r.sur_tpot_ms, "silicon")
            for r in others.itertuples()
        )
        p = next(iter(book.profiles.values()))
        out.loc[sub.index, "own_ttft_ms"] = sub["sur_ttft_ms"] * p.prefill
        out.loc[sub.index, "own_tpot_ms"] = sub["sur_tpot_ms"] * p.decode
    for m in ("ttft", "tpot"):
        out[f"own_{m}_err_pct"] = (out[f"own_{m}_ms"] - out[f"{m}_ms"]).abs() / out[f"{m}_ms"] * 100.0
    return out


def summarise(df: pd.DataFrame, who: str) -> dict[str, float]:
    ok = df[np.isfinite(df[f"{who}_ttft_err_pct"]) & np.isfinite(df[f"{who}_tpot_err_pct"])]
    if ok.empty:
        return {"n": 0}
    return {
        "n": int(len(ok)),
        "ttft_median_pct": float(np.median(ok[f"{who}_ttft_err_pct"])),
        "ttft_p90_pct": float(np.percentile(ok[f"{who}_ttft_err_pct"], 90)),
        "tpot_median_pct": float(np.median(ok[f"{who}_tpot_err_pct"])),
        "tpot_p90_pct": float(np.percentile(ok[f"{who}_tpot_err_pct"], 90)),
        "ttft_max_ratio": float(np.max(np.maximum(ok[f"{who}_ttft_ms"] / ok["ttft_ms"], ok["ttft_ms"] / ok[f"{who}_ttft_ms"]))),
        "tpot_max_ratio": float(np.max(np.maximum(ok[f"{who}_tpot_ms"] / ok["tpot_ms"], ok["tpot_ms"] / ok[f"{who}_tpot_ms"]))),
    }


PROFILE_FORMAT = 2  # 2: profiles from replays under each row's own benchmark client


def _cache_path() -> Path | None:
    """``KOI_DATA_DIR/surrogate-cache/silicon-profiles-<key>.json``; the key covers the data and the
    fitted engine overheads the operator model uses, so a refit invalidates it."""
    try:
        from koi.config import get_settings
        from koi.perf.aic import package_version
        from koi.perf.overheads import _load as overheads_doc

        key = hashlib.sha256(
            json.dumps([PROFILE_FORMAT, package_version(), overheads_doc()], sort_keys=True, default=str).encode()
        ).hexdigest()[:16]
        return Path(get_settings().data_dir) / "surrogate-cache" / f"silicon-profiles-{key}.json"
    except Exception:  # pragma: no cover - a cache is optional
        return None


def build_silicon_profiles() -> ProfileBook:
    """Measured speed ratios per (model, GPU, engine) from the silicon rows (operator model as reference)."""
    df = predict_rows(rows())
    ok = df[np.isfinite(df["sur_ttft_ms"]) & np.isfinite(df["sur_tpot_ms"])]
    return ProfileBook.from_ratios(
        (r.model, r.gpu, r.backend, r.ttft_ms / r.sur_ttft_ms, r.tpot_ms / r.sur_tpot_ms, "silicon")
        for r in ok.itertuples()
    )


@cache
def silicon_profiles() -> ProfileBook:
    """:func:`build_silicon_profiles`, cached in the process and on disk (it replays ~800 rows once)."""
    path = _cache_path()
    if path is not None and path.is_file():
        try:
            return ProfileBook.from_json(json.loads(path.read_text(encoding="utf-8")))
        except Exception as exc:
            log.warning("silicon_profiles_cache_unreadable", path=str(path), error=str(exc))
    try:
        book = build_silicon_profiles()
    except Exception as exc:  # the book is an accuracy aid, never a reason to fail a prediction
        log.warning("silicon_profiles_unavailable", error=str(exc))
        return ProfileBook()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(book.to_json(), indent=1), encoding="utf-8")
        except OSError as exc:
            log.warning("silicon_profiles_cache_unwritable", path=str(path), error=str(exc))
    return book
