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

JSON is written with ``allow_nan`` (``Infinity`` for a cost per SLO token with no SLO token)
and read back the same way; files are written to a temporary name and renamed, so a run
killed while saving leaves no half-written document.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from koi.bench.evaluator import Metrics, TickTrace
from koi.bench.llm_use import LlmUse
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
    wall_s: float
    cpu_s: float
    load_before: float | None = None
    load_after: float | None = None
    stage_s: dict[str, float] = Field(default_factory=dict, description="seconds per stage, summed over ticks")
    sim_s: float = Field(default=0.0, description="seconds advancing the world")
    store: str | None = Field(default=None, description="the run's SQLite store, when kept")
    llm: LlmUse | None = Field(default=None, description="a language-model planner's tokens, dollars and plans")
    runner_version: int = RUNNER_VERSION
    koi_version: str = ""
    code_digest: str = Field(default="", description="digest of koi/'s sources and data when the run was made")
    finished_at: str = ""


class RunResult(KoiModel):
    key: RunKey
    meta: RunMeta
    metrics: Metrics
    trace: list[TickTrace]
    plans: list[str | None] = Field(default_factory=list, description="digest of each tick's committed plan")
    jobs: list[JobInfo] = Field(default_factory=list, description="the evaluated jobs, in the records' job order")
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
            if data.get("meta", {}).get("runner_version") != RUNNER_VERSION:
                return None
            res = RunResult.model_validate(data)
        except (OSError, ValueError):
            return None
        if key is not None and res.key != key:
            return None
        return res.model_copy(update={"cached": True})

    def save(self, result: RunResult, records: np.ndarray | None = None) -> Path:
        path = self.json_path(result.key)
        if records is not None:
            _write_atomic(self.records_path(result.key), lambda p: _save_npz(p, records))
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
