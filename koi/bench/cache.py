"""The benchmark's run cache: one JSON document (metrics, trace, metadata) and one ``.npz`` (records) per run.

Layout under the cache root (default ``KOI_DATA_DIR/bench``)::

    <root>/<scenario>/runs/<policy>/seed<seed>-h<hours>-<scenario digest>.json   RunResult
    <root>/<scenario>/runs/<policy>/seed<seed>-h<hours>-<scenario digest>.npz    per-request records
    <root>/<scenario>/report/                                                    tables and figures
    <root>/<scenario>/runs-temporal/, report-temporal/                            the same through Temporal

A run is identified by (scenario digest, policy, seed, hours) and, for a language-model policy, the
digest of its model setup (model name, caps, decoding: :class:`RunKey`): editing the scenario file
or pointing the LLM policies at another model changes the key, so old runs are never mistaken for
new ones; they stay on disk until removed (the report reads the ones of the current setup,
:func:`koi.bench.report.select_runs`). ``RUNNER_VERSION`` is stored in every document and a document of another
version is a miss (recomputed), so a change to what a run records invalidates the cache.

A change to the *formulas* does not: every document also stores the evaluator's version
(:data:`koi.bench.evaluator.EVAL_VERSION`) and what the evaluator reads besides the records
(:class:`RunEvalInputs`: the jobs, the reserved commitment, the fleet cost, the admitted jobs), so a
document of another evaluator version is **re-scored** on read from its records and trace — the
metrics and the per-tick attainments recomputed, the document rewritten — instead of simulated again
(a three-hour language-model run takes up to 40 minutes; re-scoring it, about a second). A document
without those inputs (written before they were stored) or whose records are gone is a miss. Only a
document of an *older* evaluator is rewritten: one scored by a newer evaluator (a checkout behind
another that shares the cache) is re-scored in memory for this reader and left on disk as it was,
so two checkouts never take turns downgrading each other's scores.

JSON is written with ``allow_nan`` (``Infinity`` for a cost per SLO token with no SLO token)
and read back the same way; files are written to a temporary name and renamed, so a run
killed while saving leaves no half-written document.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zipfile
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from koi.bench.evaluator import EVAL_VERSION, EvalInputs, Metrics, TickTrace, evaluate, window_attainment
from koi.bench.llm_use import LlmUse
from koi.domain import Job
from koi.domain.common import KoiModel

#: Bump when what a run records changes: cached documents of another version are recomputed.
RUNNER_VERSION = 3  # 2: the p99 SLO windows metric; 3: an unfinished request's TPOT counts as infinite there


class RunKey(KoiModel):
    scenario: str = Field(description="the scenario's name (its directory in the cache)")
    scenario_digest: str
    policy: str
    seed: int
    hours: float
    llm: str = Field(default="", description="a language-model policy's setup digest "
                                             "(koi.bench.policies.llm.llm_setup_tag); empty for the others")

    @property
    def stem(self) -> str:
        base = f"seed{self.seed}-h{self.hours:g}-{self.scenario_digest[:12]}"
        return f"{base}-llm{self.llm[:12]}" if self.llm else base


class JobInfo(KoiModel):
    job_id: str
    job_class: str
    model: str
    submitted_at: float


class RunMeta(KoiModel):
    """How the run went (not part of the results; wall times vary between machines)."""

    label: str
    family: str
    via: str = Field(default="in-process", description="in-process | temporal")
    cluster_id: str
    scenario_path: str | None = None
    tick_s: float
    n_ticks: int
    horizon_s: float
    ticks_committed: int
    ticks_fallback: int
    fallbacks: list[dict[str, Any]] = Field(default_factory=list, description="tick, stage, reason of each fallback")
    clock_bound: list[dict[str, Any]] | None = Field(
        default=None, description="tick, stage and what cut it, for each tick whose plan a wall-clock limit cut "
                                  "(such a plan depends on the machine's speed); None: not recorded")
    wall_s: float
    cpu_s: float
    load_before: float | None = None
    load_after: float | None = None
    stage_s: dict[str, float] = Field(default_factory=dict, description="seconds per stage, summed over ticks")
    sim_s: float = Field(default=0.0, description="seconds advancing the world")
    store: str | None = Field(default=None, description="the run's SQLite store, when kept")
    llm: LlmUse | None = Field(default=None, description="a language-model planner's tokens, dollars and plans")
    runner_version: int = RUNNER_VERSION
    eval_version: int = Field(default=1, description="the evaluator's version the metrics were computed under "
                                                     "(documents from before it was stored: 1)")
    rescored_at: str = Field(default="", description="when the metrics were last re-scored under a newer evaluator")
    koi_version: str = ""
    code_digest: str = Field(default="", description="digest of koi/'s sources and data when the run was made")
    kernels: str = Field(default="", description="the numeric kernels the run was made with "
                                                 "(koi.numerics.kernels; empty: not recorded)")
    finished_at: str = ""


class RunEvalInputs(KoiModel):
    """What the evaluator reads besides the records and the trace, stored so a run can be re-scored."""

    jobs: list[Job] = Field(description="the evaluated jobs, in the records' job order")
    fleet_cost_usd: float = Field(ge=0)
    reserved_cost_usd: float = Field(ge=0)
    admitted_jobs: list[str] = Field(default_factory=list, description="jobs that ever had a serving replica")
    grace_s: float = Field(ge=0)


class RunResult(KoiModel):
    key: RunKey
    meta: RunMeta
    metrics: Metrics
    trace: list[TickTrace]
    plans: list[str | None] = Field(default_factory=list, description="digest of each tick's committed plan")
    jobs: list[JobInfo] = Field(default_factory=list, description="the evaluated jobs, in the records' job order")
    eval_inputs: RunEvalInputs | None = Field(default=None, description="the evaluator's other inputs (re-scoring)")
    job_cost_usd: dict[str, dict[str, float]] | None = Field(
        default=None, description="evaluated job -> market -> $ of the instances its ranks held over the run "
        "(idle reserved capacity is the fleet's, no job's); None in runs cached before it was recorded")
    cached: bool = Field(default=False, description="read from the cache rather than computed now")


def scenario_digest(scenario: Any) -> str:
    """sha256 of the scenario's canonical JSON (what the world is built from)."""
    data = scenario.model_dump(mode="json") if hasattr(scenario, "model_dump") else scenario
    raw = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 (16 hex) of every source and data file of the ``koi`` package (``*.py``, ``*.yaml``).

    Read once per process (:func:`koi.bench.runner.run_one` calls it before its first run starts, so
    an edit made while a long run is going is not credited to that run; a process runs the code it
    imported).

    Not part of the cache key (the key is the scenario, policy, seed, horizon and LLM setup): a run made by
    other code is still found, and reported as such, so a stale cache is visible (``--fresh``
    recomputes).
    """
    import koi

    root = Path(koi.__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(x for ext in ("*.py", "*.yaml") for x in root.rglob(ext)):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def default_root() -> Path:
    from koi.config import get_settings

    return Path(get_settings().data_dir).resolve() / "bench"


def _write_atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class RunCache:
    """Runs on disk, keyed by :class:`RunKey`."""

    def __init__(self, root: str | Path | None = None, *, via: str = "in-process") -> None:
        self.root = Path(root).resolve() if root is not None else default_root()
        self.via = via
        self._suffix = "" if via == "in-process" else f"-{via}"

    # ---- paths ---------------------------------------------------------------------------------------------
    def scenario_dir(self, scenario: str) -> Path:
        return self.root / scenario

    def report_dir(self, scenario: str) -> Path:
        return self.scenario_dir(scenario) / f"report{self._suffix}"

    def work_dir(self) -> Path:
        d = self.root / ".work"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def json_path(self, key: RunKey) -> Path:
        return self.scenario_dir(key.scenario) / f"runs{self._suffix}" / key.policy / f"{key.stem}.json"

    def records_path(self, key: RunKey) -> Path:
        return self.json_path(key).with_suffix(".npz")

    # ---- read and write --------------------------------------------------------------------------------------
    def load(self, key: RunKey) -> RunResult | None:
        """The cached run, or None (absent, unreadable, or written by another runner version)."""
        return self._read(self.json_path(key), key)

    def _read(self, path: Path, key: RunKey | None = None) -> RunResult | None:
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            meta = data.get("meta", {})
            if meta.get("runner_version") != RUNNER_VERSION:
                return None
            stored_version = int(meta.get("eval_version", 1))
            stale = stored_version != EVAL_VERSION
            if stale:
                data = self._rescored(data, path.with_suffix(".npz"))
                if data is None:
                    return None
            res = RunResult.model_validate(data)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if key is not None and res.key != key:
            return None
        if stale and stored_version < EVAL_VERSION:  # never downgrade a newer evaluator's document
            with contextlib.suppress(OSError):  # a read-only cache still reports the re-scored numbers
                self._write_json(res, path)
        return res.model_copy(update={"cached": True})

    @staticmethod
    def _rescored(data: dict[str, Any], records_path: Path) -> dict[str, Any] | None:
        """The document with its metrics and per-tick attainments recomputed by the current evaluator
        (None when it cannot be: no stored evaluator inputs or no records). Works on the raw document,
        so metrics of an older shape never need to validate."""
        if not data.get("eval_inputs") or not records_path.is_file():
            return None
        ei = RunEvalInputs.model_validate(data["eval_inputs"])
        meta = data["meta"]
        with np.load(records_path, allow_pickle=False) as z:
            rec = z["records"]
        trace = [TickTrace.model_validate(t) for t in data.get("trace", [])]
        per_tick = window_attainment(ei.jobs, rec, int(meta["n_ticks"]), float(meta["tick_s"]),
                                     float(meta["horizon_s"]), ei.grace_s)
        for t, (a, b) in zip(trace, per_tick, strict=True):
            t.ttft_attainment, t.tpot_attainment = a, b
        metrics = evaluate(EvalInputs(jobs=ei.jobs, records=rec, horizon_s=float(meta["horizon_s"]),
                                      fleet_cost_usd=ei.fleet_cost_usd, reserved_cost_usd=ei.reserved_cost_usd,
                                      trace=trace, admitted_jobs=set(ei.admitted_jobs), grace_s=ei.grace_s,
                                      window_s=float(meta["tick_s"])))
        return {**data, "metrics": metrics.model_dump(mode="json"), "trace": [t.model_dump(mode="json") for t in trace],
                "meta": {**meta, "eval_version": EVAL_VERSION,
                         "rescored_at": datetime.now(UTC).isoformat(timespec="seconds")}}

    def save(self, result: RunResult, records: np.ndarray | None = None) -> Path:
        if records is not None:
            _write_atomic(self.records_path(result.key), lambda p: _save_npz(p, records))
        return self._write_json(result, self.json_path(result.key))

    @staticmethod
    def _write_json(result: RunResult, path: Path) -> Path:
        body = json.dumps(result.model_dump(mode="json", exclude={"cached"}), indent=1, allow_nan=True)
        _write_atomic(path, lambda p: p.write_text(body, encoding="utf-8"))
        return path

    def records(self, key: RunKey) -> np.ndarray | None:
        p = self.records_path(key)
        if not p.is_file():
            return None
        with np.load(p, allow_pickle=False) as z:
            return z["records"]

    def runs(self, scenario: str, *, digest: str | None = None, hours: float | None = None) -> list[RunResult]:
        """Every readable cached run of a scenario (optionally of one scenario digest and horizon)."""
        base = self.scenario_dir(scenario) / f"runs{self._suffix}"
        out = []
        for p in sorted(base.glob("*/*.json")):
            r = self._read(p)
            if r is None:
                continue
            if digest is not None and r.key.scenario_digest != digest:
                continue
            if hours is not None and abs(r.key.hours - hours) > 1e-9:
                continue
            out.append(r)
        return sorted(out, key=lambda r: (r.key.policy, r.key.seed))


#: zlib level of the per-request records. Level 1 writes a 3-hour run's ~90 MB of records about 3× faster
#: than ``np.savez_compressed``'s default (about 1 s against 4 s) for files about 10% larger; still a
#: plain ``.npz`` that ``np.load`` reads.
NPZ_LEVEL = 1


def _save_npz(path: Path, records: np.ndarray) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=NPZ_LEVEL) as zf, \
            zf.open("records.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array(f, np.asanyarray(records), allow_pickle=False)
