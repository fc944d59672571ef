"""The capacity search of :class:`~koi.surrogate.core.Surrogate` (a mixin).

One replica's sustainable req/s: for an online job the largest rate at most ``utilization_cap``
(Appendix B's 0.8) × saturation whose predicted p99 TTFT and TPOT (after residual correction) meet
the job's targets; for a batch job its saturation rate. A chain the PerfDB holds no record of in its
own fine scope (every chain of a cold surrogate, a chain never run) must meet
``unseen_tpot_margin`` × its p99 TPOT target instead of the target itself (below).
``_capacity`` is the vectorised search (every candidate solved at the cap, those failing there
tree-bisected in log rate, :mod:`koi.surrogate.bisect`); ``rank_capacity`` and ``capacity_many``
are the public API on it.
Kept apart from :mod:`koi.surrogate.core` so the search lives in one module; the core's
``predict_many`` and ``predict_ladder`` call it through ``self``.

The arrivals an engine sees depend on how many engines share the job's stream (a round-robin
gateway thins a bursty stream, :func:`koi.surrogate.prep.engines_sharing`), so a replica's capacity is
found at the thinning its own rate implies: at λ per replica the job's rate Λ needs Λ/λ replicas,
each engine seeing the job's CV times √(λ/(Λ·dp)). A bursty job's capacity per replica thus grows
with its rate (more replicas share its bursts out), as in the simulator and behind a real gateway.

The mixin holds no state of its own: it reads the surrogate's ``residuals``, ``utilization_cap``
and ``unseen_tpot_margin`` and calls the core's solve helpers (``_physics``, ``_prepare``,
``_run``, ``_speeds``, ``_saturation``, ``_factor_columns``) through ``self``.

Choice (the spec sizes a replica to "the p99 targets" and says nothing of a margin): an unseen
chain is sized to 95% of its TPOT target. Its prediction is the physics, or a correction borrowed
from other chains on the same GPU, and a request's TPOT law is narrow — it averages hundreds of
decode steps, so its p99 sits a few percent above its median — while the evaluator counts every
request: a rank sized to a TPOT prediction 2% low misses 10–35% of its requests (hetero-12h's
agent-235b, a never-run TP4PP2 H100 rank predicted at 59.8 ms against 60 and run at a median
of 60). TTFT has no margin: its law is wide (queueing), so a small bias at the p99 moves only a
few requests. A chain with records of its own is sized to the target: its correction is its own.
Measured against no margin (composite, mean over seeds): hetero-12h, seeds 0–2, Koi 89.23
against 87.86 (agent-235b's p99 windows 36% → 82%) and the rolling MILP 87.92 against 89.03;
hetero-3h, seeds 0–5, Koi −0.11 ± 0.20 (better on 3 of 6) and the MILP (which never learns, so
every chain is unseen) +0.52 ± 0.10 (6 of 6; +0.46 at 90%). The margin on every chain, seen ones
included, cost Koi 0.44 ± 0.35 on hetero-3h: there it stacks on the chain's own learned correction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.common import JobClass
from koi.domain.job import Job
from koi.surrogate.bisect import tree_bisect
from koi.surrogate.outputs import Capacity, SurrogateError
from koi.surrogate.physics import WorkloadDigest
from koi.surrogate.prep import _NEAREST_SKIP, _Prep, _scope, engines_sharing
from koi.surrogate.scope import Scope

#: Halvings of log(rate) in the capacity search (≈ 0.7% precision over the 10³ range searched).
CAP_BISECT = 10
#: An unseen chain's p99 TPOT must meet this fraction of the target (module docstring).
UNSEEN_TPOT_MARGIN = 0.95


class CapacityMixin:
    """``_capacity``, ``rank_capacity``, ``capacity_many``."""

    # ---- capacity -----------------------------------------------------------------------------------
    def _capacity(
        self, job: Job, prep: _Prep, sat_rep: np.ndarray, scopes: list[Scope], skips: list[tuple[str, ...]]
    ) -> tuple[np.ndarray, list[str]]:
        """Per-replica sustainable req/s and what limits it (see the module docstring).

        All candidates are solved at once at the cap; those whose p99 targets fail there are
        bisected (vectorised, ``CAP_BISECT`` halvings of log rate) between a near-idle rate and the
        cap — latency grows with load, so the largest rate meeting both targets is found. A chain
        that misses a target even near idle has capacity 0 (limited by that target).
        """
        m = len(sat_rep)
        if self.residuals.n_records:
            fac = self._factor_columns(scopes, skips)
            f_tpot = fac.get("p99_tpot_ms", np.ones(m))
            f_ttft = fac.get("p99_ttft_ms", np.ones(m))
        else:
            f_tpot = f_ttft = np.ones(m)
        sat = sat_rep  # the learned speed is already in the prepared tables
        if job.job_class is not JobClass.ONLINE:
            return sat, ["saturation"] * m
        tt_t, tp_t = job.slo.p99_ttft_ms, job.slo.p99_tpot_ms
        # an unseen chain's TPOT is sized to the margin: its factor is divided by it (module docstring)
        f_tpot = f_tpot / self._tpot_margins(scopes)

        rate = float(job.workload.arrival.rate_rps or 0.0)

        def slack(sub: _Prep, lam: np.ndarray, fi: np.ndarray, fp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """log of the worse of (p99 TTFT / target, p99 TPOT / target): ≤ 0 where both hold."""
            # the gateway's thinning at the replica count this rate implies (module docstring)
            thin = engines_sharing(rate, lam / sub.f["dp"])
            sub = _Prep(sub.d, sub.rows, {**sub.f, "thin": thin}, sub.flags, sub.index)
            r, _ = self._run(sub, lam, mediators=False)
            a = (r.ttft_p99 + sub.f["request_s"]) * 1e3 * fi / tt_t
            b = r.tpot_p99 * 1e3 * fp / tp_t
            return np.log(np.maximum(np.maximum(a, b), 1e-12)), a >= b

        top = self.utilization_cap * sat
        w_top, ttft_binds = slack(prep, top, f_ttft, f_tpot)
        cap = np.where(w_top <= 0.0, top, 0.0)
        limited = np.where(w_top <= 0.0, "utilization", np.where(ttft_binds, "p99_ttft_ms", "p99_tpot_ms")).tolist()
        fail = np.flatnonzero(w_top > 0.0)
        if len(fail):
            # the targets fail at the cap: bisect in log(rate) between a near-idle rate and the cap
            sub = prep.take(fail)
            fi, fp = f_ttft[fail], f_tpot[fail]
            lo = np.log(np.maximum(1e-3 * sat[fail], 1e-9))
            hi = np.log(top[fail])
            w_lo, _ = slack(sub, np.exp(lo), fi, fp)
            possible = np.flatnonzero(w_lo <= 0.0)
            cap[fail] = 0.0
            if len(possible):  # only those meeting both targets near idle are bisected (rows are independent)
                sub = sub.take(possible) if len(possible) < len(fail) else sub
                fi, fp = fi[possible], fp[possible]

                def good_at(mids: np.ndarray) -> np.ndarray:
                    """Both targets hold at the log rates ``mids`` (K, m): one solve over K × m rows."""
                    K = mids.shape[0]
                    w, _ = slack(sub.tile(K), np.exp(mids.T.ravel()), np.repeat(fi, K), np.repeat(fp, K))
                    return (w <= 0.0).reshape(len(fi), K).T

                cap[fail[possible]] = np.exp(tree_bisect(good_at, lo[possible], hi[possible], CAP_BISECT))
        return cap, limited

    def _tpot_margins(self, scopes: list[Scope]) -> np.ndarray:
        """Per candidate: 1 where the PerfDB holds records in its fine scope, else ``unseen_tpot_margin``."""
        rm = self.residuals
        margin = float(self.unseen_tpot_margin)
        if not rm.n_records:
            return np.full(len(scopes), margin)
        return np.array([1.0 if rm.support(s) > 0 else margin for s in scopes], dtype=float)

    def rank_capacity(self, job: Job, chain: Chain) -> Capacity:
        """Max sustainable req/s (and output tok/s) of ONE replica of ``chain`` for ``job``."""
        return self.capacity_many(job, [chain])[0]

    def capacity_many(self, job: Job, chains: Sequence[Chain], *,
                      speed: float | Sequence[float] | np.ndarray | None = None) -> list[Capacity]:
        """Per-replica capacity of each chain for ``job``; ``speed`` multiplies each chain's iteration
        times on top of the learned speed (a what-if, as in :meth:`predict_many`)."""
        try:
            arch = catalog.model(job.model)
        except catalog.CatalogError as exc:
            raise SurrogateError(str(exc)) from exc
        d = WorkloadDigest.of(job.workload)
        phys = self._physics(arch, list(chains), d)
        out: list[Capacity | None] = [None] * len(phys)
        idx = [i for i, p in enumerate(phys) if p.feas.ok]
        for i, p in enumerate(phys):
            if not p.feas.ok:
                out[i] = Capacity(0.0, 0.0, 0.0, "infeasible", False, tuple(p.feas.reasons), tuple(p.flags))
        if idx:
            ph = [phys[i] for i in idx]
            prep = self._prepare(arch, d, ph)
            fl = prep.flags
            chains = list(chains)
            sc = [_scope(job, chains[i], arch) for i in idx]
            skips = [_NEAREST_SKIP if any(f.startswith("nearest_arch:") for f in fl[j]) else () for j in range(len(idx))]
            spd = self._speeds(sc, skips)
            if speed is not None:
                spd = spd * np.broadcast_to(np.asarray(speed, dtype=float), (len(chains),))[idx]
            prep.scale(spd)
            sat = self._saturation(prep)
            cap, limited = self._capacity(job, prep, sat, sc, skips)
            for j, i in enumerate(idx):
                out[i] = Capacity(float(cap[j]), float(cap[j] * d.osl), float(sat[j]), limited[j], True, (), fl[j])
        return [c for c in out if c is not None]
