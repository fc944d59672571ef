"""S(x, e, W) → (V̂, Ŷ): the surrogate's vectorised core (whitepaper, "The Surrogate Stack";
overview §2.3; sizing from "The Agentic Planner").

Composition, per candidate chain (all candidates of a call are solved together in numpy):

1. C2 feasibility and instance links (:mod:`koi.surrogate.feasibility`);
2. decode and marginal-prefill iteration tables from koi.perf's measured-operator step
   model (:mod:`koi.surrogate.physics`), rescaled by the model's measured speed ratios or
   its nearest profiled architecture's (:mod:`koi.surrogate.profiles`), and by the
   iteration speed learned for the candidate's scope (:meth:`ResidualModel.speed`);
3. the steady state under the offered load (:mod:`koi.surrogate.queueing`): live batch,
   iteration time, p99 TTFT/TPOT, queue, saturation;
4. memory and KV mediators from koi.perf's memory plan;
5. learned output corrections (:mod:`koi.surrogate.residual`), then cost per token and
   SLO margin from koi.outcomes. ``base_values`` are steps 1–4 without anything learned.

Rank-level conventions (choices where the spec is vague):

- a rank's n replicas share its offered load equally (round-robin router);
- latencies and mediators are those of one engine (as the simulator's telemetry reports
  them: per-engine means); ``throughput_tokens_per_sec`` and ``preemption_rate`` are rank
  totals;
- ``throughput_tokens_per_sec`` is output tokens/s actually served (min of offered and
  saturation); ``cost_per_token`` is the rank's $/h over it (koi.outcomes);
- batch jobs with no offered rate run saturated: offered = the replicas' saturation rate;
- ``gpu_mem_used_fraction`` counts weights, activation peak, reserve and the KV blocks in
  use (not the preallocated pool); ``vram_headroom_gb`` is VRAM minus that, per GPU;
- ``per_tok_comm_bytes``: payload bytes handed to collectives per *output* token: two TP
  all-reduces of hidden×bf16 per layer and ``2·hidden`` bf16 per pipeline boundary for
  every processed token (prompt and output), divided by the output tokens;
- ``preemption_rate``: a request is preempted when it arrives while the decoding population
  (mean and spread from the queueing model's birth–death law) exceeds what the KV pool holds
  at the mean footprint, so the rate is ``λ · P(N > B_kv)`` (normal approximation);
  ``kv_pressure_score`` = (KV in use
  ``B · (isl_computed + osl/2)`` + the prompts of the queue) / KV capacity.

The utilisation cap for online jobs is Appendix B's UTILIZATION = 0.8: a replica's
capacity is the largest rate at most 0.8 × saturation whose predicted p99 TTFT and TPOT
(after residual correction) meet the job's targets.

Layout: :class:`Surrogate` here holds the composition (preparation, steady-state solve, values,
corrections, ``predict_many``, ``predict_rank``, ``predict_ladder``); the capacity search
(``rank_capacity``, ``capacity_many``) comes from :mod:`koi.surrogate.capacity_mixin` and the
closed-loop mode (``closed_loop``) from :mod:`koi.surrogate.closed_loop_mixin`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from koi import catalog, outcomes
from koi.domain.chain import Chain, Ladder, Rank
from koi.domain.common import JobClass
from koi.domain.job import Job
from koi.domain.model import ModelArch
from koi.logging import get_logger
from koi.surrogate import queueing
from koi.surrogate.capacity_mixin import CAP_BISECT as CAP_BISECT
from koi.surrogate.capacity_mixin import UNSEEN_TPOT_MARGIN as UNSEEN_TPOT_MARGIN
from koi.surrogate.capacity_mixin import CapacityMixin
from koi.surrogate.closed_loop_mixin import ClosedLoopMixin
from koi.surrogate.ladder_mix import _combine_ladder
from koi.surrogate.outputs import _ALL_NAMES, BatchPrediction, SurrogateError
from koi.surrogate.physics import B_GRID, ChainPhysics, WorkloadDigest, chain_physics
from koi.surrogate.prep import (
    _NEAREST_SKIP,
    _ROW_KEYS,
    _SCALAR_KEYS,
    _Prep,
    _prep_row,
    _scope,
    _scope_cached,
    engines_sharing,
)
from koi.surrogate.pricing import _cached_price, _rank_prices
from koi.surrogate.profiles import ProfileBook
from koi.surrogate.residual import ResidualModel
from koi.surrogate.scope import Scope
from koi.surrogate.types import LadderPrediction, RankPrediction

log = get_logger(__name__)

UTILIZATION_CAP = 0.8  # Appendix B, "Online per-replica utilization cap"
#: Load of a batch job's replicas when it names no rate, as a fraction of saturation: the job is a
#: backlog the gateway's dispatcher keeps feeding, so every replica runs full (all the slots its KV
#: pool allows busy, the saturation rate served) — the saturated state of the queueing model.
BATCH_LOAD = 1.0
#: The gateway's batch dispatcher (the platform's, not a hidden effect: koi.sim's World implements
#: it as ``_batch_topup``): every second it tops each engine's waiting queue up to ``3 ×`` the
#: completions of the last second plus 8, within [16, 128] and at most the free slots plus 16.
#: The telemetry samples the queue after a second's admissions (one second of completions).
BATCH_TOPUP = {"per_completion": 3.0, "extra": 8.0, "lo": 16.0, "hi": 128.0, "slots_extra": 16.0}


def batch_standing_queue(completions_per_s: np.ndarray, running: np.ndarray, max_seqs: np.ndarray) -> np.ndarray:
    """Requests a backlogged (batch) engine holds waiting: the dispatcher's top-up target (see
    :data:`BATCH_TOPUP`) less the second of admissions that follows it."""
    c = BATCH_TOPUP
    mu = np.asarray(completions_per_s, dtype=float)
    target = np.minimum(np.clip(np.ceil(c["per_completion"] * mu) + c["extra"], c["lo"], c["hi"]),
                        np.maximum(max_seqs - running, 0.0) + c["slots_extra"])  # fmt: skip
    return np.maximum(target - mu, 0.0)

#: Prior relative σ of each objective before residuals exist, read off `koi surrogate eval`
#: (median absolute errors of the simulator grid before learning: p99 TTFT ~27%, p99 TPOT
#: ~19%, throughput ~2%; silicon TPOT ~7-13%): a σ near the typical miss, not the p90 tail
#: (the DRO band adds the tail through ε and, once they exist, the residual quantiles).
SIGMA_PRIOR: dict[str, float] = {
    "p99_ttft_ms": 0.35,
    "p99_tpot_ms": 0.20,
    "throughput_tokens_per_sec": 0.05,
    "cost_per_token": 0.05,
    "slo_margin": 0.25,
}
#: σ multipliers for predictions resting on borrowed data or on fragile regimes.
UNCERTAINTY = {"rescaled_gpu": 1.5, "nearest_arch": 1.3, "tp_across_nodes": 1.25, "near_saturation": 1.5}
#: pseudo-records after which residual support has halved the extra uncertainty.
SUPPORT_HALF = 5.0


def _norm_cdf(x: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(x)


# ---- the surrogate -----------------------------------------------------------------------------------
class Surrogate(CapacityMixin, ClosedLoopMixin):
    """The planner's forward model. Pure given (residuals, profiles): no I/O, deterministic.

    ``residuals``: learned corrections (``ResidualModel.fit(records)``); none by default.
    ``profiles``: measured speed ratios for the nearest-architecture rule (a ProfileBook; see
    :meth:`from_records`), ``"silicon"`` for aiconfigurator-core's measured rows, or None.

    Choice: silicon profiles are opt-in. They describe real H100/H200 silicon (engine
    scheduling artefacts included); in the simulated world, whose physics is the operator
    model itself, they would import deviations that world does not have. A real fleet turns
    them on. PerfDB profiles are opt-in too (:meth:`from_records`).

    ``unseen_tpot_margin``: an online chain with no PerfDB record in its own fine scope is sized
    to this fraction of the p99 TPOT target (:mod:`koi.surrogate.capacity_mixin` says why).
    """

    def __init__(
        self,
        residuals: ResidualModel | None = None,
        profiles: ProfileBook | str | None = None,
        *,
        utilization_cap: float = UTILIZATION_CAP,
        unseen_tpot_margin: float = UNSEEN_TPOT_MARGIN,
    ):
        self.residuals = residuals or ResidualModel.empty()
        self._profiles_arg = profiles
        self._profiles: ProfileBook | None = profiles if isinstance(profiles, ProfileBook) else None
        self.utilization_cap = utilization_cap
        if not 0.0 < unseen_tpot_margin <= 1.0:
            raise ValueError(f"unseen_tpot_margin must be in (0, 1], got {unseen_tpot_margin}")
        self.unseen_tpot_margin = unseen_tpot_margin
        self._prof_cache: dict[tuple[str, str], tuple[float, float, str | None]] = {}

    @classmethod
    def from_records(cls, records: Sequence, *, silicon: bool = False, perfdb_profiles: bool = False,
                     **kw) -> Surrogate:
        """A surrogate that has learned from PerfDB records: residual corrections (plus the silicon
        profiles when ``silicon``, and PerfDB-measured ones for the nearest-architecture rule when
        ``perfdb_profiles``).

        Choice: PerfDB profiles are off by default. The nearest-architecture rule is for a model
        the operator tables cannot profile (the whitepaper's "missing profiles"); every catalog
        model has operator physics here, so borrowing a neighbour's PerfDB speed replaced a
        model's own physics on that GPU with another job's workload-specific error (a RAG job's
        prefill-bound p99 TPOT, inverted into a "slow GPU", resized every 70B model on it) and
        dropped the shrunken GPU/environment effects the residual learner fits for exactly that.
        Measured on hetero-3h (seeds 0–2, Koi): with them 84.8 / 82.7 / 82.6, without 85.1 /
        85.2 / 82.2.
        """
        residuals = ResidualModel.fit(records)
        book = ProfileBook.from_residuals(residuals) if perfdb_profiles else ProfileBook()
        if silicon:
            from koi.surrogate.silicon import silicon_profiles

            book = book.merged(silicon_profiles())
        return cls(residuals=residuals, profiles=book, **kw)

    # ---- profiles ------------------------------------------------------------------------------------
    @property
    def profiles(self) -> ProfileBook:
        if self._profiles is None:
            if self._profiles_arg == "silicon":
                from koi.surrogate.silicon import silicon_profiles

                self._profiles = silicon_profiles()
            else:
                self._profiles = ProfileBook()
        return self._profiles

    def _profile(self, arch: ModelArch, gpu: str, engine: str) -> tuple[float, float, str | None]:
        key = (arch.name, gpu, engine)
        if key not in self._prof_cache:
            self._prof_cache[key] = self.profiles.lookup(arch, gpu, catalog.models(), engine)
        return self._prof_cache[key]

    # ---- feasibility ---------------------------------------------------------------------------------
    @staticmethod
    def feasibility(model: str | ModelArch, chain: Chain, job: Job | None = None) -> tuple[bool, list[str]]:
        from koi.surrogate.feasibility import feasibility

        return feasibility(model, chain, job.workload if job is not None else None)

    # ---- the vectorised evaluation -----------------------------------------------------------------------
    def _physics(self, arch: ModelArch, chains: Sequence[Chain], d: WorkloadDigest) -> list[ChainPhysics]:
        key = d.lengths_key
        out = []
        for c in chains:
            try:
                out.append(chain_physics(arch.name, c.env.gpu_type, c.env.cloud, c.config, key))
            except catalog.CatalogError as exc:
                raise SurrogateError(str(exc)) from exc
        return out

    def _prepare(self, arch: ModelArch, d: WorkloadDigest, phys: list[ChainPhysics], profile: bool = True) -> _Prep:
        """Per-candidate arrays of the feasible chains in ``phys`` (tables, memory, knobs, flags)."""
        mats, scal, flags = [], [], []
        osl_r = float(round(d.osl))
        for p in phys:
            cfg = p.chain_key[3]
            hit = d.hit_rate(cfg.prefix_caching)
            fp, fd, flag = self._profile(arch, p.chain_key[1], cfg.engine_name) if profile else (1.0, 1.0, None)
            mat, sc = _prep_row(p, hit, float(max(round(d.isl * (1.0 - hit)), 1)),
                                float(max(round(d.isl_p99 * (1.0 - hit)), 1)), osl_r, fp, fd)  # fmt: skip
            mats.append(mat)
            scal.append(sc)
            flags.append(tuple(p.flags) + ((flag,) if flag else ()))
        M = np.stack(mats) if mats else np.zeros((0, len(_ROW_KEYS), len(B_GRID)))
        S = np.stack(scal) if scal else np.zeros((0, len(_SCALAR_KEYS)))
        rows = {k: M[:, i, :] for i, k in enumerate(_ROW_KEYS)}
        f = {k: S[:, i] for i, k in enumerate(_SCALAR_KEYS)}
        f["isl_eff"] = np.maximum(d.isl * (1.0 - f["hit"]), 1.0)
        f["isl99_eff"] = np.maximum(d.isl_p99 * (1.0 - f["hit"]), 1.0)
        # KV footprint of a running sequence, time-averaged (what "blocks in use" averages over): its
        # computed prompt plus the output generated so far, half a block of rounding. A sequence stays
        # in the batch for a time proportional to its output, so the output part is the length-biased
        # mean E[osl²]/(2·E[osl]) = osl·(1 + cv²)/2; TRT-LLM (GUARANTEED_NO_EVICT) holds the whole
        # output from admission, E[osl²]/E[osl]. The shared prefix's blocks are held once per engine.
        osl_lb = d.osl * (1.0 + d.osl_cv**2)
        f["per_seq_kv"] = f["isl_eff"] + np.where(f["trt"] > 0, osl_lb, osl_lb / 2.0) + f["block"] / 2.0
        f["kv_shared"] = np.where(f["hit"] > 0, float(d.prefix_len), 0.0)
        f["b_kv"] = np.maximum(f["kv_tok"] - f["kv_shared"], 1.0) / f["per_seq_kv"]
        # B_GRID tops at 4096 sequences; max_num_seqs above it is clamped there.
        f["b_cap"] = np.maximum(np.minimum(np.minimum(f["mseq"], np.floor(f["b_kv"])), B_GRID[-1]), 1.0)
        return _Prep(d, rows, f, flags)

    def _run(self, prep: _Prep, lam_replica: np.ndarray, closed: np.ndarray | None = None, *, mediators: bool = True
             ) -> tuple[queueing.LoadResult, dict[str, np.ndarray]]:  # fmt: skip
        """Steady state of prepared candidates at per-replica rates (or closed-loop concurrencies).

        ``mediators=False`` skips the time-averaged communication and bubble shares (the extra dict then
        holds only the prepared scalars): the capacity search and the saturation solve read latencies and
        rates only, and the averages over the population's atoms cost a third of a small solve."""
        d, rows, f, ix = prep.d, prep.rows, prep.f, prep.index
        n = len(f["dp"])
        ones = np.ones(n)
        inp = queueing.LoadInputs(
            lam=np.asarray(lam_replica, dtype=float) / f["dp"],
            isl=f["isl_eff"],
            isl_p99=f["isl99_eff"],
            isl_cv=ones * d.isl_cv,
            osl=ones * d.osl,
            osl_p05=ones * d.osl_p05,
            osl_cv=ones * d.osl_cv,
            ca=ones * d.ca,
            # the gateway thins the job's stream over its engines (f["thin"], see predict_many)
            ca_engine=d.ca / np.sqrt(f["thin"]) if "thin" in f else None,
            b_grid=B_GRID,
            t_dec=rows["t_dec"],
            c_pf=rows["cpf"],
            c_pf_p99=rows["cpf99"],
            b_cap=f["b_cap"],
            budget=f["budget"],
            chunked=f["chunked"].astype(bool),
            rows=ix,
        )
        res = queueing.solve(inp) if closed is None else queueing.solve_closed_loop(inp, closed)
        if not mediators:
            return res, f
        share = res.prefill_share[:, None]
        n_at = res.atoms.shape[1]
        row_of = np.repeat(np.arange(n) if ix is None else ix, n_at)
        b_atoms = np.maximum(res.atoms, 1.0).ravel()

        comm_dec, comm_pf, bub_dec = (a.reshape(n, n_at) for a in queueing.interp_rows_many(
            B_GRID, (rows["comm_dec"], rows["comm_pf"], rows["bub_dec"]), b_atoms, row_of))

        # Time averages over the engine's busy time (the telemetry's definition): each state of the
        # running batch weighs its stationary probability; the idle state only while a prompt is
        # being prefilled (probability λ·prefill time), at the one-sequence iteration.
        busy = np.where(res.atoms > 0.0, 1.0, np.minimum(inp.lam * res.prefill_s, 1.0)[:, None])
        w = res.weights * busy
        wsum = np.maximum(w.sum(axis=1), 1e-300)
        extra = dict(f)
        extra["comm"] = np.sum(w * ((1 - share) * comm_dec + share * comm_pf), axis=1) / wsum
        extra["bubble"] = np.sum(w * bub_dec, axis=1) / wsum
        return res, extra

    def _solve(self, arch: ModelArch, d: WorkloadDigest, phys: list[ChainPhysics], lam_replica: np.ndarray, *,
               closed_concurrency: np.ndarray | None = None, profile: bool = True):  # fmt: skip
        """:meth:`_prepare` + :meth:`_run` (steady state of feasible chains)."""
        prep = self._prepare(arch, d, phys, profile)
        res, extra = self._run(prep, lam_replica, closed_concurrency)
        return res, extra, prep.flags

    def _saturation(self, prep: _Prep) -> np.ndarray:
        """Per-replica saturation req/s, solved at full batch (so prompt cost is taken at B_cap)."""
        res, x = self._run(prep, np.full(len(prep.flags), 1e12), mediators=False)
        return res.lam_sat * x["dp"]

    def _values(
        self, arch: ModelArch, d: WorkloadDigest, res: queueing.LoadResult, x: dict[str, np.ndarray], n_rep: np.ndarray,
        backlog: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """Rank-level V and Y (before derived outcomes), registry names."""
        dp = x["dp"]
        kv_tok = np.maximum(x["kv_tok"], 1.0)
        lam_e = res.lam_served
        # requests in PREFILL (Little: λ · prefill time) hold half their prompt on average and count in
        # the running batch, as the engine counts them (running = prefilling + decoding)
        prefilling = lam_e * res.prefill_s
        live = np.where(res.saturated, res.batch, np.minimum(res.batch + prefilling, x["b_cap"]))
        in_use = res.batch * x["per_seq_kv"] + prefilling * x["isl_eff"] / 2.0 + x["kv_shared"]
        kv_util = np.minimum(in_use / kv_tok, 1.0)
        # requests held but not admitted: the front end (koi.perf's per-request time) plus the wait
        # before the prefill starts (queueing.solve: Little's law over it)
        queue = res.queue_depth + lam_e * x["request_s"]
        if backlog is not None and backlog.any():
            # a backlogged (batch) engine: its waiting queue is what the dispatcher keeps there
            queue = np.where(backlog, batch_standing_queue(lam_e, live, x["mseq"]), queue)
        # demand: blocks in use plus the blocks the waiting prompts need, whole (the telemetry's definition)
        pressure = (in_use + queue * (d.isl + x["block"] / 2.0)) / kv_tok
        used = x["weights"] + x["act"] + x["reserve"] + kv_util * x["kv_bytes"]
        # P(decoding population > KV-limited batch), normal approximation of the population law
        b = np.maximum(res.batch, 1e-9)
        p_over = 1.0 - _norm_cdf((x["b_kv"] - b) / np.maximum(res.batch_sd, 1.0))
        preempt = res.lam_served * dp * p_over * n_rep
        tokens_per_out = (x["isl_eff"] + d.osl) / max(d.osl, 1.0)
        h = arch.hidden_size
        tp, pp = x["tp"], x["pp"]
        # payload per processed token: 2 TP all-reduces of hidden×bf16 per layer, 2·hidden bf16 per
        # pipeline boundary; per output token: the vocabulary all-gather of the sampled row
        per_tok = 2.0 * arch.num_layers * h * 2.0 * (tp > 1) + (pp - 1) * 2.0 * h * 2.0
        vocab = arch.vocab_size * 2.0 * (tp > 1)
        return {
            "throughput_tokens_per_sec": res.lam_served * dp * d.osl * n_rep,
            "p99_ttft_ms": (res.ttft_p99 + x["request_s"]) * 1e3,
            "p99_tpot_ms": res.tpot_p99 * 1e3,
            "kv_cache_util": kv_util,
            "kv_pressure_score": pressure,
            "gpu_mem_used_fraction": used / x["vram"],
            "vram_headroom_gb": (x["vram"] - used) / 1e9,
            "pipeline_bubble_fraction": x["bubble"],
            "comm_overhead_pct": 100.0 * x["comm"],
            "per_tok_comm_bytes": per_tok * tokens_per_out + vocab,
            "kvcache_hit_rate": x["hit"],
            "live_batch_size": live,
            "queue_depth": queue,
            "preemption_rate": preempt,
            "input_length_observed": np.full(len(b), d.isl),
            "output_length_observed": np.full(len(b), d.osl),
        }

    # ---- public: many candidates ----------------------------------------------------------------------------
    def predict_many(
        self,
        job: Job,
        chains: Sequence[Chain],
        *,
        offered_rps: float | Sequence[float] | np.ndarray | None = None,
        n_replicas: int | Sequence[int] | np.ndarray = 1,
        price_per_gpu_hour: float | Sequence[float] | np.ndarray | None = None,
        tokens_remaining: float | None = None,
        seconds_left: float | None = None,
        with_capacity: bool = True,
        speed: float | Sequence[float] | np.ndarray | None = None,
        with_base: bool = True,
    ) -> BatchPrediction:
        """Predictions for many candidate ranks of one job (the planner's hot path).

        ``offered_rps``: the rate offered to each rank (default: the job's arrival rate; batch
        jobs without one run saturated). ``price_per_gpu_hour`` default: catalog list price of
        the chain's instance in its environment. ``tokens_remaining``/``seconds_left`` feed the
        batch SLO margin (default: the job's whole budget and deadline). ``with_capacity=False``
        skips the capacity search (``capacity_rps`` is then 0) for scoring at a fixed load only.
        ``speed`` multiplies every iteration time of each candidate (a what-if, and how the
        residual learner probes the physics); the learned speed of the candidate's scope
        (:meth:`ResidualModel.speed`) is applied on top. ``with_base=False`` skips the physics-only
        run a learned surrogate makes for ``base_values`` (then NaN; the ``kv_preemption`` flag reads
        the corrected KV pressure): the planner's latency and rank-value lookups read only ``values``,
        and the second run is a third of their cost. ``values`` are the same either way.
        """
        try:
            arch = catalog.model(job.model)
        except catalog.CatalogError as exc:
            raise SurrogateError(str(exc)) from exc
        chains = list(chains)
        n = len(chains)
        d = WorkloadDigest.of(job.workload)
        n_rep = np.broadcast_to(np.asarray(n_replicas, dtype=float), (n,)).copy()
        if price_per_gpu_hour is None:
            price = np.array([_cached_price(c.env, c.config.instance_type) for c in chains])
        else:
            price = np.broadcast_to(np.asarray(price_per_gpu_hour, dtype=float), (n,)).copy()
        gpus = np.array([c.config.gpus for c in chains], dtype=float)
        hourly = price * gpus * n_rep
        phys = self._physics(arch, chains, d)
        ok = np.array([p.feas.ok for p in phys], dtype=bool)
        is_online = job.job_class is JobClass.ONLINE
        if offered_rps is None:
            rate = job.workload.arrival.rate_rps
            offered = np.full(n, rate if (is_online or rate > 0) else np.nan)
        else:
            offered = np.broadcast_to(np.asarray(offered_rps, dtype=float), (n,)).copy()

        names = _ALL_NAMES
        vals = {k: np.full(n, np.nan) for k in names}
        base = {k: np.full(n, np.nan) for k in names}
        unc = np.ones(n)
        cap = np.zeros(n)
        sat = np.zeros(n)
        aux = {k: np.full(n, np.nan) for k in ("ttft_mean_ms", "tpot_mean_ms", "utilization", "batch_cap")}
        flags: list[tuple[str, ...]] = [tuple(p.flags) for p in phys]
        reasons: list[tuple[str, ...]] = [tuple(p.feas.reasons) for p in phys]
        scopes: list[Scope | None] = [None] * n
        support = np.zeros(n, dtype=int)
        idx = np.flatnonzero(ok)
        if len(idx):
            ph = [phys[i] for i in idx]
            prep = self._prepare(arch, d, ph)
            fl = prep.flags
            sc = [_scope(job, chains[i], arch) for i in idx]
            skips = [_NEAREST_SKIP if any(f.startswith("nearest_arch:") for f in fl[j]) else () for j in range(len(idx))]
            spd = self._speeds(sc, skips)
            what_if = np.ones(len(idx)) if speed is None else np.broadcast_to(np.asarray(speed, dtype=float), (n,))[idx]
            learned = bool(np.any(spd != 1.0))
            base_run = learned and with_base
            if base_run:
                # the base (physics alone, what PerfDB stores and the learner inverts) needs its own run
                base_prep = self._prepare(arch, d, ph)
                base_prep.scale(what_if)
            prep.scale(spd * what_if)
            # saturation first (needed when a batch job runs saturated), then the offered load
            sat_rep = self._saturation(prep)
            off = offered[idx]
            prep.f["thin"] = _thinning(job, off, n_rep[idx], prep.f["dp"])
            if base_run:
                base_prep.f["thin"] = prep.f["thin"]
                sat_base = self._saturation(base_prep)
                lam_rep = np.where(np.isnan(off), sat_rep * n_rep[idx] * BATCH_LOAD, off) / n_rep[idx]
                res_b, x_b = self._run(base_prep, np.where(np.isnan(off), sat_base * BATCH_LOAD, lam_rep))
                v_base = self._values(arch, d, res_b, x_b, n_rep[idx], np.isnan(off))
            else:
                lam_rep = np.where(np.isnan(off), sat_rep * n_rep[idx] * BATCH_LOAD, off) / n_rep[idx]
            offered[idx] = lam_rep * n_rep[idx]
            res, x = self._run(prep, lam_rep)
            v = self._values(arch, d, res, x, n_rep[idx], np.isnan(off))
            corr = self._correct(v, sc, skips)
            corr["throughput_tokens_per_sec"] = np.minimum(corr["throughput_tokens_per_sec"], sat_rep * n_rep[idx] * d.osl)
            if base_run:
                v = v_base
            # capacity (per replica) under the cap and targets, corrected
            cap_rep, limited = self._capacity(job, prep, sat_rep, sc, skips) if with_capacity else (np.zeros(len(idx)), [])
            cap[idx], sat[idx] = cap_rep, sat_rep
            for k in names:
                if k in v:
                    if with_base:
                        base[k][idx] = v[k]
                    vals[k][idx] = corr[k]
            for j, i in enumerate(idx):
                extra_flags = list(fl[j])
                if res.saturated[j]:
                    extra_flags.append("saturated")
                if v["kv_pressure_score"][j] > 1.0:
                    extra_flags.append("kv_preemption")
                flags[i] = tuple(dict.fromkeys(extra_flags))
                scopes[i] = sc[j]
            rho = res.rho
            aux["ttft_mean_ms"][idx] = (res.ttft_mean + prep.f["request_s"]) * 1e3
            aux["tpot_mean_ms"][idx] = res.t_step * 1e3
            aux["utilization"][idx] = rho
            aux["batch_cap"][idx] = x["b_cap"]
            u = np.ones(len(idx))
            for j in range(len(idx)):
                m = 1.0
                for fg in flags[idx[j]]:
                    m *= UNCERTAINTY.get(fg.split(":", 1)[0], 1.0)
                if rho[j] > 0.9:
                    m *= UNCERTAINTY["near_saturation"]
                support[idx[j]] = self.residuals.support(sc[j]) if self.residuals.n_records else 0
                u[j] = 1.0 + (m - 1.0) * SUPPORT_HALF / (SUPPORT_HALF + support[idx[j]])
            unc[idx] = u
        # derived outcomes on both the base and the corrected values
        for tgt in (base, vals):
            tgt["cost_per_token"] = outcomes.cost_per_token(hourly, np.nan_to_num(tgt["throughput_tokens_per_sec"]))
            if is_online:
                tgt["slo_margin"] = outcomes.online_slo_margin(
                    tgt["p99_ttft_ms"], tgt["p99_tpot_ms"], job.slo.p99_ttft_ms, job.slo.p99_tpot_ms
                )
            else:
                rem = job.total_token_budget if tokens_remaining is None else tokens_remaining
                left = job.slo.deadline_s if seconds_left is None else seconds_left
                tgt["slo_margin"] = outcomes.batch_slo_margin(rem, left, np.nan_to_num(tgt["throughput_tokens_per_sec"]))
            for k in names:
                tgt[k] = np.where(ok, tgt[k], np.nan)
        return BatchPrediction(
            chains=chains,
            n_replicas=n_rep,
            offered_rps=np.nan_to_num(offered),
            values=vals,
            base_values=base,
            feasible=ok,
            reasons=reasons,
            flags=flags,
            uncertainty=unc,
            capacity_rps=cap,
            saturation_rps=sat,
            hourly_cost=hourly,
            aux=aux,
            scopes=scopes,
            job=job,
            sigma_rel=dict(SIGMA_PRIOR),
            support=support,
        )

    def _speeds(self, scopes: list[Scope], skips: list[tuple[str, ...]]) -> np.ndarray:
        """Learned iteration-time multipliers of the candidates' scopes (1 when nothing was learned)."""
        if not self.residuals.n_records:
            return np.ones(len(scopes))
        return np.array([self.residuals.speed(s, k) for s, k in zip(scopes, skips, strict=True)])

    def _correct(self, v: dict[str, np.ndarray], scopes: list[Scope], skips: list[tuple[str, ...]]) -> dict[str, np.ndarray]:
        if not self.residuals.n_records:
            return {k: a.copy() for k, a in v.items()}
        out = {}
        fac = self._factor_columns(scopes, skips)
        for k, a in v.items():
            out[k] = a * fac[k] if k in fac else a.copy()
        return out

    def _factor_columns(self, scopes: list[Scope], skips: list[tuple[str, ...]]) -> dict[str, np.ndarray]:
        """Learned output factors of the candidates' scopes, quantity -> (n,) (one lookup per scope)."""
        rm = self.residuals
        qs = list(rm.effects)
        if not scopes:
            return {q: np.zeros(0) for q in qs}
        rows = np.array([rm.factor_row(s, sk) for s, sk in zip(scopes, skips, strict=True)], dtype=float)
        return {q: rows[:, i] for i, q in enumerate(qs)}

    # ---- public: one rank, one ladder (capacity: CapacityMixin) ---------------------------------------------
    def predict_rank(
        self,
        job: Job,
        rank: Rank,
        offered_rps: float | None = None,
        price_per_gpu_hour: float | None = None,
        **kw,
    ) -> RankPrediction:
        """S(x, e, W) for one rank at ``offered_rps`` (default: the job's arrival rate)."""
        b = self.predict_many(job, [rank.chain], offered_rps=offered_rps, n_replicas=rank.n_replicas,
                              price_per_gpu_hour=price_per_gpu_hour, **kw)  # fmt: skip
        return b.rank(0)

    def predict_ladder(
        self,
        job: Job,
        ladder: Ladder,
        prices: Sequence[float] | Mapping[str, float] | None = None,
        offered_rps: float | None = None,
        **kw,
    ) -> LadderPrediction:
        """Ladder-level outcomes: the offered load split across ranks in proportion to capacity.

        ``prices``: $/GPU-hour per rank (a sequence in rank order, or a mapping env_id → price);
        default the catalog's. Combination (a choice; the spec says "ladder outcomes"):

        - throughput: the sum over ranks; cost per token: all ranks' $/h over it (koi.outcomes);
        - p99 TTFT/TPOT: the p99 of the *mixture* of the ranks' latency distributions weighted
          by their load shares, each rank's tail exponential through its mean and p99 — equal
          to the worst rank's p99 when it carries most load, and moving toward the others' as
          its share falls below 1%; ladders never look better than their loaded ranks;
        - mediators: load-weighted means; queue depth and preemption rate: sums;
        - SLO margin from the ladder p99s (online) or the ladder throughput (batch).
        """
        ranks = ladder.ranks
        price_list = _rank_prices(ranks, prices)
        chains = [r.chain for r in ranks]
        n_rep = np.array([r.n_replicas for r in ranks], dtype=float)
        caps = self.capacity_many(job, chains)
        cap_rank = np.array([c.rps for c in caps]) * n_rep
        if cap_rank.sum() <= 0:
            cap_rank = np.array([c.saturation_rps for c in caps]) * n_rep
        total = job.workload.arrival.rate_rps if offered_rps is None else float(offered_rps)
        online = job.job_class is JobClass.ONLINE
        split = cap_rank / cap_rank.sum() if cap_rank.sum() > 0 else np.full(len(ranks), 1.0 / len(ranks))
        per_rank = None if total <= 0 and not online else split * total  # None: a batch job runs saturated
        preds: list[RankPrediction] = []
        for i, r in enumerate(ranks):
            b = self.predict_many(job, [r.chain], n_replicas=r.n_replicas, price_per_gpu_hour=price_list[i],
                                  offered_rps=None if per_rank is None else per_rank[i], **kw)  # fmt: skip
            preds.append(b.rank(0))
        feasible = all(p.feasible for p in preds)
        reasons = [f"rank {i}: {m}" for i, p in enumerate(preds) for m in p.reasons]
        flags = sorted({f for p in preds for f in p.flags})
        hourly = float(sum(p.hourly_cost for p in preds))
        values = _combine_ladder(preds, split, job, hourly, **kw) if feasible else {}
        return LadderPrediction(
            job_id=job.job_id,
            offered_rps=float(total if per_rank is not None else sum(p.offered_rps for p in preds)),
            values=values,
            ranks=preds,
            load_split=[float(s) for s in split],
            flags=flags,
            uncertainty=max((p.uncertainty for p in preds), default=1.0),
            feasible=feasible,
            reasons=reasons,
            capacity_rps=float(cap_rank.sum()) if feasible else 0.0,
            hourly_cost=hourly,
            total_gpus=ladder.total_gpus,
        )

# ---- module helpers ------------------------------------------------------------------------------------------
def _thinning(job: Job, offered: np.ndarray, n_rep: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """Engines sharing the job's stream (:func:`koi.surrogate.prep.engines_sharing`) for a rank offered
    ``offered`` req/s (a ladder's share, or the whole job; NaN: a batch job run saturated) over
    ``n_rep`` replicas of ``dp`` engines each."""
    return engines_sharing(float(job.workload.arrival.rate_rps or 0.0), offered / np.maximum(n_rep * dp, 1.0))


def clear_caches() -> None:
    """Empty the surrogate's process caches (physics, tables, prepared rows, scopes, prices)."""
    from koi.surrogate import physics

    physics.clear_caches()
    _prep_row.cache_clear()
    _scope_cached.cache_clear()
    _cached_price.cache_clear()


# ---- default instance and module-level API ----------------------------------------------------------------
_DEFAULT: Surrogate | None = None


def default_surrogate() -> Surrogate:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Surrogate()
    return _DEFAULT
