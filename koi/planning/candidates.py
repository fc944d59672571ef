"""Candidates and ladder sizing (overview §2.6; whitepaper, "The Agentic Planner": enumerate_ladder,
size_ladder, predict_outcome, compute_* tools).

Per job: the chains its budget slice allows (C2 through the predictor) → replicas sized
to its demand → ladders (single-rank, and split across pools when one pool is short) →
Ŷ, J, p_brk, SwitchCost, σ → C3 filter → dominance pruning → the few best.

This module is the generator that sizes and assembles them; the parts live beside it: the option
types (:mod:`koi.planning.options`), demand (:mod:`koi.planning.demand`), config enumeration
(:mod:`koi.planning.enumeration`), and Ŷ, p_brk and SwitchCost of a ladder with the "Ladder
outcomes" and "Unserved share" choices (:mod:`koi.planning.ladder_eval`).

Sizing (white paper: "it plots batch sizes on a throughput-vs-deadline curve. For online
jobs, it rejects configurations where the predicted p99 TTFT/TPOT exceeds the target
and caps utilization"):
- **online**: the predictor's per-replica capacity already respects the 0.8 utilisation
  cap and the p99 targets (a chain that cannot meet them at any load has capacity 0 and
  is rejected). n_min = ⌈λ / cap⌉. We also offer a headroom point n_min + max(1, ⌊n_min/2⌋)
  (at most 2·n_min): more replicas, lower load, a shorter tail and a lower breach
  probability — the selector takes it when risk or latency weight pays for the extra GPUs,
  or when n_min's breach probability is above τ (C3 drops n_min then).
- **batch**: remaining output tokens R, time left T (minus the cold start for a new
  ladder): n(deadline) = ⌈R·(1 + slack) / (T · tok/s per replica)⌉ — the point on the
  throughput-versus-deadline curve that meets the deadline with 15% slack — and a
  faster point at 2× that rate. A job past its deadline (or with under one tick left)
  is sized to finish within one tick interval.

Choices:
- **Late batch jobs.** When no candidate of a batch job meets its deadline with p_brk ≤ τ
  (the deadline is out of reach), C3 is waived for that job — it is "late" — and its
  candidates compete on σ (their risk still costs γ·p_brk; the fast points of the deadline
  curve have the most margin). Otherwise such a job
  could never be admitted, which C6 forbids.
- **Repairs.** C3 is a chance constraint on *new* ladders; the running ladder is kept whatever
  its risk. When that ladder breaches (its p_brk at ε, or its own last window's observed risk,
  above τ), a ladder whose p_brk is below the running one's is an option even above τ — a
  *repair* — and competes on σ like any other (its risk costs γ·p_brk). Without the waiver the
  filter kept the job on the riskier ladder: on homo-12h (Koi, seed 1) agent-235b lost one of
  twelve replicas to a pool outage (observed risk 0.95); the ladder that added three replicas on
  another pool's free instances scored p_brk 0.24 against τ = 0.2, was filtered out, and the
  job kept its breaching ladder — "no alternative" — for 12 ticks. The validator (S5) waives C3
  for the same ladders (``JobCandidates.repair_below``).
- **Scale-out.** An active job whose running ladder breaches C3 (the model's p_brk at ε, or its
  own last window's observed risk, above τ) or leaves demand unserved also gets ladders that keep
  every running rank and grow one of them or add one on another pool — on free instances, and on
  whole pools as reservation targets for when the fleet is full
  (:func:`koi.planning.split.scale_out_ladders`). Without them its only repairs were rebuilds:
  in place where its pool is full (the share S6 releases first is dark for a cold start: on hetero-3h, seeds 0 and 2, a 70B RAG
  service slowed by the H100 driver update was charged a 32% gap for every repair, kept its
  breaching ladder for ten ticks and met its p99 TPOT on ~45% of requests meanwhile), or split
  ladders whose first rank must meet τ alone, which a slowed GPU's chains no longer do.
- **Scale-in.** An active online job whose running ladder holds more SLO capacity than its demand
  needs also gets that ladder with one rank shrunk to the n_min and headroom points
  (:func:`koi.planning.split.scale_in_ladders`): the mirror of scale-out, so capacity a repair
  added is given back when it is no longer worth its price (SwitchCost: a drain; no gap). A rank launched
  inside the settle window is held while the ladder is healthy (:func:`koi.planning.split.sheds_settling`).
- **Rehome.** An active job's running ladder with one rank's replicas moved, chain unchanged, onto free
  reserved instances of its GPU type that plan cheaper — idle committed capacity, which otherwise only a
  rebuild of the whole ladder could reach (:func:`koi.planning.split.rehome_ladders`).
- **Hardware classes.** A predictor that is not environment-sensitive predicts once per
  (GPU type, instance shape) and the result fans out over the pools of that class, which
  differ only in price; an environment-sensitive one is called per pool.
- **Causal risk** (overview §2: uncertain relationships "increase estimated risk"): a kept
  candidate's and the running ladder's p_brk are read at a radius moved by the causal doubt of the
  stories they rest on (:mod:`koi.planning.causal_risk`); C3 stays at ε.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from koi import catalog, outcomes
from koi.domain.chain import Chain, ChainConfig, Ladder
from koi.domain.cluster import ClusterSnapshot, Pool
from koi.domain.common import JobClass, stable_hash
from koi.domain.hardware import Environment
from koi.domain.job import JobState, JobStatus
from koi.domain.model import ModelArch
from koi.planning.budget import BudgetSlice
from koi.planning.capacity import PlanningPrices, PoolIndex, held_replicas, instances_for, size_online
from koi.planning.causal_risk import fleet_centre, widened
from koi.planning.context import PlanningContext
from koi.planning.demand import batch_curve, demand_tps
from koi.planning.enumeration import chain_configs
from koi.planning.ladder_eval import evaluate_ladders, switch_costs
from koi.planning.options import Candidate, JobCandidates, OptionKind, RankSpec
from koi.planning.predictor import ChainEstimate
from koi.planning.split import SplitRows, ladder_key, running_moves, sheds_settling, split_ladders
from koi.planning.transition import transition_gaps
from koi.scoring.exploration import EMPTY, Activation
from koi.scoring.tchebycheff import reference_point, tchebycheff

__all__ = ["Candidate", "CandidateGenerator", "JobCandidates", "OptionKind", "RankSpec", "generate"]


# ---- the generator ----------------------------------------------------------------------------------
@dataclass
class _Proto:
    """A (chain, n) on a hardware class, evaluated once and fanned out over the class's pools."""

    config: ChainConfig
    est: ChainEstimate
    n: int
    cls: int
    instances: int
    cold_s: float


def _signature(js: JobState) -> str:
    """Identity of what a per-replica prediction depends on; it keys the estimate cache too. The rate
    belongs to it: a replica's capacity under the p99 targets depends on how many replicas share the
    job's bursts (koi.surrogate.capacity_mixin), not only on the chain, the request shape and targets."""
    j = js.job
    w = j.workload.model_dump(mode="json")
    return stable_hash({"m": j.model, "w": w, "c": j.job_class.value, "t": [j.slo.p99_ttft_ms, j.slo.p99_tpot_ms]})


class CandidateGenerator:
    """Builds :class:`JobCandidates` for the jobs of one snapshot (caches across jobs of one pass).

    Per job everything stays in numpy arrays — one row per (prototype, pool) — until the
    pruning has chosen the survivors; only those become :class:`Candidate` objects. The
    full scored set (``JobCandidates.all_scored``, used by C6 and the baselines) is built
    on demand from the same arrays.
    """

    def __init__(self, snapshot: ClusterSnapshot, ctx: PlanningContext) -> None:
        self.snapshot = snapshot
        self.ctx = ctx
        self.pools = PoolIndex(snapshot.resources)
        self._est_cache: dict[tuple[str, str, int], list[tuple[ChainConfig, ChainEstimate]]] = {}
        self._cfg_cache: dict[tuple, list[ChainConfig]] = {}
        self._feat_cache: dict[tuple, Activation] = {}
        self._cold_cache: dict[tuple, float] = {}
        self._pid: dict[int, str] = {id(p): pid for pid, p in self.pools.by_id.items()}
        self._chains: dict[tuple[int, int], Chain] = {}
        self._chain_est: dict[tuple, ChainEstimate] = {}
        self._prices = PlanningPrices(self.pools, snapshot.deployments, ctx.knobs.committed_share)
        self._centre: float | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _classes(self, slice_: BudgetSlice | None) -> list[tuple[str, list[Pool]]]:
        """Hardware classes of the allowed pools (or single pools for an env-sensitive predictor)."""
        allowed = slice_.pool_ids if slice_ is not None else sorted(self.pools.by_id)
        groups: dict[str, list[Pool]] = defaultdict(list)
        for pid in allowed:
            p = self.pools.by_id.get(pid)
            if p is None:
                continue
            key = pid if self.ctx.predictor.env_sensitive else f"{p.env.gpu_type}|{p.instance_type}|{p.gpus_per_instance}"
            groups[key].append(p)
        return [(k, sorted(groups[k], key=lambda p: p.pool_id)) for k in sorted(groups)]

    def _configs(self, model: ModelArch, rep: Pool, job_class: JobClass, max_gpus: int) -> list[ChainConfig]:
        key = (model.name, rep.instance_type, rep.gpus_per_instance, rep.env.gpu_type, job_class, max_gpus)
        hit = self._cfg_cache.get(key)
        if hit is None:
            gpu = catalog.gpu(rep.env.gpu_type)
            hit = chain_configs(model, rep.instance_type, rep.gpus_per_instance, gpu.supports_fp8, job_class,
                                self.ctx, max_gpus)
            self._cfg_cache[key] = hit
        return hit

    def _estimates(self, js: JobState, sig: str, classes: list[tuple[str, list[Pool]]], max_gpus: int,
                   model: ModelArch) -> list[list[tuple[ChainConfig, ChainEstimate]]]:
        """Feasible chains with capacity for this job, per hardware class, bounded (EnumerationParams).

        Configs are walked per (class, dtype, preset) from the smallest shape up, in rounds batched
        across all groups and classes (one predictor call per round): the cheap C2 check first,
        then an estimate for the feasible ones, until each group has ``shapes_per_dtype`` chains
        that can carry load under the p99 targets (or has no shapes left). Estimating is what
        costs, and the smallest feasible shapes are the ones kept, so most of the enumeration is
        never predicted. Results are cached per (job shape, class) for the other jobs of the pass.
        """
        out: list[list[tuple[ChainConfig, ChainEstimate]] | None] = [
            self._est_cache.get((sig, ckey, max_gpus)) for ckey, _ in classes]
        todo = [ci for ci, hit in enumerate(out) if hit is None]
        k = self.ctx.enum.shapes_per_dtype
        order: dict[tuple, list[int]] = {}
        cfgs: dict[int, list[ChainConfig]] = {}
        for ci in todo:
            rep = classes[ci][1][0]
            configs = cfgs[ci] = self._configs(model, rep, js.job.job_class, max_gpus)
            groups: dict[tuple, list[int]] = defaultdict(list)
            for i, c in enumerate(configs):
                groups[(ci, str(c.weight_dtype), str(c.kv_dtype), c.max_num_seqs)].append(i)
            for g, ix in groups.items():
                order[g] = sorted(ix, key=lambda i, cf=configs: (cf[i].gpus, cf[i].pp, cf[i].tp))
        done: dict[tuple, list[int]] = {g: [] for g in order}
        pos = dict.fromkeys(order, 0)
        ests: dict[tuple[int, int], ChainEstimate] = {}
        gkeys = sorted(order)
        while True:
            batch: list[tuple[tuple, int]] = []
            for g in gkeys:
                want = k - len(done[g])
                if want <= 0 or pos[g] >= len(order[g]):
                    continue
                nxt = order[g][pos[g]: pos[g] + want]
                pos[g] += len(nxt)
                batch += [(g, i) for i in nxt]
            if not batch:
                break
            chains = [self._chain(classes[g[0]][1][0].env, cfgs[g[0]][i]) for g, i in batch]
            feas = self.ctx.predictor.feasible(js.job, chains)
            live = [(gi, ch) for gi, ch, (ok, _) in zip(batch, chains, feas, strict=True) if ok]
            if not live:
                continue
            got = self.ctx.predictor.estimate(js.job, [ch for _, ch in live])
            for ((g, i), ch), e in zip(live, got, strict=True):
                ests[(g[0], i)] = e
                self._chain_est[(sig, ch.env.gpu_type, ch.env.cloud, cfgs[g[0]][i])] = e
                if e.feasible and e.cap_tps > 0:
                    done[g].append(i)
        for ci in todo:
            idx = sorted(i for g, ix in done.items() if g[0] == ci for i in ix)
            res = [(cfgs[ci][i], ests[(ci, i)]) for i in idx]
            self._est_cache[(sig, classes[ci][0], max_gpus)] = res
            out[ci] = res
        return [x if x is not None else [] for x in out]

    def _cold(self, model: ModelArch, cfg: ChainConfig, gpi: int) -> float:
        key = (model.name, cfg.weight_dtype, cfg.tp * cfg.pp * cfg.dp, gpi)
        hit = self._cold_cache.get(key)
        if hit is None:
            sp = self.ctx.switch
            nodes = max(1, math.ceil(key[2] / gpi))
            hit = model.weight_bytes(cfg.weight_dtype) / 1e9 / nodes / sp.load_bw_gbs + sp.warmup_s
            self._cold_cache[key] = hit
        return hit

    def _spec(self, pool: Pool, cfg: ChainConfig, est: ChainEstimate, n: int, model: ModelArch, job_id: str,
              env: Environment | None = None) -> RankSpec:
        gpi = pool.gpus_per_instance
        e = env or pool.env
        pid = self._pid.get(id(pool)) or pool.pool_id
        return RankSpec(pid, e, cfg, n, est, instances_for(cfg.tp * cfg.pp * cfg.dp, n, gpi),
                        self._prices.unit(pid, pool, job_id), gpi,
                        self._cold(model, cfg, gpi), self._chain(e, cfg))

    def _chain(self, env: Environment, cfg: ChainConfig) -> Chain:
        key = (id(env), id(cfg))
        hit = self._chains.get(key)
        if hit is None or hit.env is not env or hit.config is not cfg:
            hit = Chain(env=env, config=cfg)
            self._chains[key] = hit
        return hit

    def current_specs(self, js: JobState, model: ModelArch) -> tuple[RankSpec, ...] | None:
        """The running ladder of an active job as RankSpecs (predicted anew for this tick).

        A *degraded* rank is scored with the replicas that actually materialised (its capacity
        is what serves traffic; the overview's Mixtral example: one of two replicas up), and it
        holds only their instances: a replica that failed to materialise released its instances,
        and a reclaimed or failed instance is gone from the pool (the snapshot's ``free_instances``
        already reflect both). Counting the lost instances as still held made a "recover" swap to
        the same ladder look free in a pool that had lost capacity, so the planner re-issued it
        every tick without effect (measured on hetero-3h: 14–17 futile swaps of one job per run).
        Launching ranks count as planned.
        """
        ladder = self.snapshot.ladder_of(js.job.job_id)
        if ladder is None:
            return None
        specs = list(self.ladder_specs(js, ladder, model))
        deps = [d for d in self.snapshot.deployments if d.job_id == js.job.job_id and d.is_live]
        for i, d in enumerate(deps):
            n = held_replicas(d)  # the one definition C1 and S6 use too (koi.planning.capacity)
            if n < d.rank.n_replicas and i < len(specs):
                specs[i] = specs[i].with_n(n)
        return tuple(specs)

    def _settling(self, js: JobState) -> list[bool]:
        """Per running rank (in :meth:`current_specs`' order): launched at most ``enum.settle_ticks`` ago."""
        w = self.ctx.enum.settle_ticks
        deps = [d for d in self.snapshot.deployments if d.job_id == js.job.job_id and d.is_live]
        return [w > 0 and self.snapshot.tick - d.since_tick <= w for d in deps]

    def ladder_specs(self, js: JobState, ladder: Ladder, model: ModelArch | None = None) -> tuple[RankSpec, ...]:
        """Any ladder (e.g. a proposed one) as RankSpecs; ranks on unknown pools get price 0."""
        model = model or catalog.model(js.job.model)
        chains = [r.chain for r in ladder.ranks]
        ests: list[ChainEstimate | None] = [None] * len(chains)
        if not self.ctx.predictor.env_sensitive:  # a chain the enumeration already estimated for this job shape
            sig = _signature(js)
            for i, c in enumerate(chains):
                ests[i] = self._chain_est.get((sig, c.env.gpu_type, c.env.cloud, c.config))
        missing = [i for i, e in enumerate(ests) if e is None]
        if missing:
            got = self.ctx.predictor.estimate(js.job, [chains[i] for i in missing])
            for i, e in zip(missing, got, strict=True):
                ests[i] = e
        out = []
        for r, e in zip(ladder.ranks, ests, strict=True):
            p = self.pools.pool_of(r)
            if p is None:
                out.append(RankSpec(f"?{r.env.env_id}/{r.config.instance_type}", r.env, r.config, r.n_replicas, e,
                                    r.n_replicas, 0.0, max(r.config.gpus, 1), self._cold(model, r.config, 8)))
            else:
                out.append(self._spec(p, r.config, e, r.n_replicas, model, js.job.job_id, env=r.env))
        return tuple(out)

    def activation(self, js: JobState, ranks: Sequence[RankSpec], model: ModelArch, sig: str | None = None) -> Activation:
        """The edges and mechanisms a ladder exercises (union over its ranks; cached per job shape and chain)."""
        ex = self.ctx.exploration
        if not ex.mechanisms:
            return EMPTY
        from koi.causal.features import rank_features

        act = EMPTY
        sig = sig or _signature(js)
        for r in ranks:
            key = (sig, r.env.env_id, r.config)
            a = self._feat_cache.get(key)
            if a is None:
                inst = None
                if r.config.instance_type:
                    try:
                        inst = catalog.instance(r.env.cloud, r.config.instance_type)
                    except catalog.CatalogError:
                        inst = None
                try:
                    gpu = catalog.gpu(r.env.gpu_type)
                except catalog.CatalogError:
                    gpu = None
                f = rank_features(js.job, (r.env, r.config), model, gpu, inst)
                a = ex.applicable(f)
                self._feat_cache[key] = a
            act = act.union(a)
        return act

    def doubt_centre(self) -> float:
        """d̄ of the causal widening, from the running ladders (:func:`koi.planning.causal_risk.fleet_centre`)."""
        if self._centre is None:
            snap = self.snapshot
            ladders = [(js, snap.ladder_of(js.job.job_id)) for js in snap.jobs if js.status is JobStatus.ACTIVE]
            self._centre = fleet_centre(self.ctx.exploration, [
                self.activation(js, lad.ranks, catalog.model(js.job.model)) for js, lad in ladders if lad])
        return self._centre

    # -- the job -----------------------------------------------------------------------------------
    def for_job(self, js: JobState, slice_: BudgetSlice | None) -> JobCandidates:
        ctx, knobs, now = self.ctx, self.ctx.knobs, self.snapshot.now
        job = js.job
        model = catalog.model(job.model)
        online = job.job_class is JobClass.ONLINE
        weights = np.asarray(knobs.weights_for(job.job_class, job.weights).as_tuple())
        current = self.current_specs(js, model) if js.status is JobStatus.ACTIVE else None
        max_gpus = slice_.max_gpus if slice_ is not None else self.snapshot.resources.total_gpus
        sig = _signature(js)
        tick_s = ctx.switch.tick_s
        kind = OptionKind.SWAP if current else OptionKind.PLACE

        # 1. chains per hardware class, sized into prototypes
        classes = self._classes(slice_)
        protos: list[_Proto] = []
        n_chains = 0
        per_class = self._estimates(js, sig, classes, max_gpus, model)
        for ci, (_ckey, pools) in enumerate(classes):
            ests = per_class[ci]
            n_chains += len(ests)
            gpi = pools[0].gpus_per_instance
            for cfg, est in ests:
                cold = self._cold(model, cfg, gpi)
                if online:
                    n0 = size_online(job.workload.arrival.rate_rps, est.cap_rps)
                    ns = [n0, min(math.ceil(n0 * ctx.enum.online_max_headroom), n0 + max(1, n0 // 2))] if n0 else []
                else:
                    ns = batch_curve(demand_tps(js, now, tick_s, cold), est.sat_tps, ctx.enum.batch_slack,
                                     ctx.enum.batch_fast_factor)
                for k in sorted(set(ns)):
                    if k * cfg.gpus > max_gpus:  # cap at the slice's bound (a short ladder, maybe late)
                        k = max_gpus // cfg.gpus
                    if k >= 1:
                        protos.append(_Proto(cfg, est, k, ci, instances_for(cfg.gpus, k, gpi), cold))
        # dedupe protos capped to the same n
        uniq: dict[tuple, _Proto] = {}
        for p in protos:
            uniq.setdefault((p.cls, p.config, p.n), p)
        protos = list(uniq.values())

        # 2. evaluate prototypes once (on the class's first pool), fan out over the class's pools
        P = len(protos)
        keep_eval = None
        if P or current:
            rep: list[tuple[RankSpec, ...]] = [(self._spec(classes[p.cls][1][0], p.config, p.est, p.n, model, job.job_id),)
                                               for p in protos]
            start = [p.cold_s for p in protos]
            if current:  # the running ladder rides in the same predictor call (no start-up: it runs)
                rep.append(current)
                start.append(0.0)
            ev = evaluate_ladders(js, rep, ctx, now, np.array(start))
            if current:
                keep_eval = ev.rows(slice(P, None))
        rows_p: list[int] = []
        rows_pool: list[Pool] = []
        for i, p in enumerate(protos):
            for pool in classes[p.cls][1]:
                rows_p.append(i)
                rows_pool.append(pool)
        F = len(rows_p)
        rows_pid = [self._pid[id(pl)] for pl in rows_pool]
        rp = np.array(rows_p, dtype=int)
        inst = np.array([protos[i].instances for i in rows_p], dtype=float)
        price = inst * np.array([self._prices.unit(pid, pl, job.job_id) for pid, pl in zip(rows_pid, rows_pool, strict=True)]) \
            if F else np.zeros(0)
        if F:
            y = ev.y[rp].copy()
            y[:, 0] = outcomes.cost_per_token(price, ev.served_tps[rp])
            p_brk, unserved = ev.p_brk[rp], ev.unserved[rp]
            served, capacity = ev.served_tps[rp], ev.capacity_tps[rp]
        else:
            y = np.zeros((0, 5))
            p_brk = unserved = served = capacity = np.zeros(0)

        def row_spec(f: int) -> RankSpec:
            p = protos[rows_p[f]]
            return self._spec(rows_pool[f], p.config, p.est, p.n, model, job.job_id)

        dem = demand_tps(js, now, tick_s)

        # 3. split ladders across pools when the best pools are short
        lam = job.workload.arrival.rate_rps if online else 0.0
        own: dict[str, int] = defaultdict(int)  # an active job's split ladders may reuse its own instances
        for r in current or ():
            own[r.pool_id] += r.instances
        rows = SplitRows(rows_p, rows_pool, rows_pid, protos, y, p_brk, row_spec)
        hetero = split_ladders(rows, ctx, self.pools.by_id, weights=weights, online=online, lam=lam, own=own)
        if js.status is JobStatus.PENDING:  # and over whole pools: what a reservation can make room for
            seen_keys = {ladder_key(h) for h in hetero}
            hetero += [h for h in split_ladders(rows, ctx, self.pools.by_id, weights=weights, online=online,
                                                lam=lam, whole_pools=True)
                       if ladder_key(h) not in seen_keys]
        settling = self._settling(js) if current else []
        if current:  # the running ladder's own moves: scale-out, scale-in, rehome (split.running_moves)
            hetero += running_moves(rows, ctx, current, pools=self.pools.by_id, weights=weights, online=online,
                                    demand_tps=dem, breaching=keep_eval is not None and self._breaching(js, keep_eval),
                                    known={ladder_key(h) for h in hetero}, settling=settling)
        if hetero:
            hev = evaluate_ladders(js, hetero, ctx, now, np.array([max(r.cold_s for r in h) for h in hetero]))
        H = len(hetero)
        all_y = np.vstack([y, hev.y]) if H else y
        all_p = np.concatenate([p_brk, hev.p_brk]) if H else p_brk
        all_p_hi = None  # p_brk at the widest causal radius (module docstring, "Causal risk")
        if P and ev.p_brk_hi is not None:
            all_p_hi = np.concatenate([ev.p_brk_hi[rp], hev.p_brk_hi]) if H and hev.p_brk_hi is not None \
                else ev.p_brk_hi[rp]

        # 4. the running ladder was scored on the same footing in step 2 (keep_eval)

        # 5. reference point, J, switch, σ
        ref_y = all_y if keep_eval is None else np.vstack([all_y, keep_eval.y])
        ref = reference_point(ref_y, ctx.history.get(job.job_id)) if len(ref_y) else None
        z, rng = ref.arrays() if ref is not None else (np.zeros(5), np.ones(5))
        j_all = tchebycheff(all_y, weights, z, rng, knobs.rho) if len(all_y) else np.zeros(0)
        sw = np.zeros(F + H)
        cur_cfgs = [r.config for r in current] if current else []
        proto_cur = [any(p.config == c for c in cur_cfgs) for p in protos]
        if current:
            cur_price = sum(r.price for r in current)
            cur_pools = {r.pool_id for r in current}
            sp = ctx.switch
            usd_new = price / 3600.0
            usd_old = cur_price / 3600.0
            norm = np.maximum(np.maximum(usd_new, usd_old), 1e-12) * sp.tick_s
            cold = np.array([protos[i].cold_s for i in rows_p]) if F else np.zeros(0)
            sw[:F] = (cold * usd_new + (sp.overlap_s + sp.drain_s) * usd_old + p_brk * sp.tick_s * usd_new) / norm
            for f in range(F):  # rows that may share a chain with the running ladder: exact item path
                if proto_cur[rows_p[f]] and rows_pid[f] in cur_pools:
                    sw[f] = switch_costs(current, [(row_spec(f),)], p_brk[f:f + 1], ctx)[0]
            if H:
                sw[F:] = switch_costs(current, hetero, hev.p_brk, ctx)
        sigma = j_all - knobs.gamma * all_p - knobs.lam * sw
        all_unserved = np.concatenate([unserved, hev.unserved]) if H else unserved
        all_served = np.concatenate([served, hev.served_tps]) if H else served
        all_cap = np.concatenate([capacity, hev.capacity_tps]) if H else capacity

        def ranks_of(i: int) -> tuple[RankSpec, ...]:
            return (row_spec(i),) if i < F else hetero[i - F]

        if current:  # an in-place swap's released share goes dark for its cold start (transition_gaps)
            touch = [i for i in range(F + H) if (rows_pid[i] in cur_pools if i < F else
                                                 any(r.pool_id in cur_pools for r in hetero[i - F]))]
            if touch:
                free = {pid: pl.free_instances for pid, pl in self.pools.by_id.items()}
                gaps = transition_gaps(current, [ranks_of(i) for i in touch], free, ctx.switch.tick_s)
                all_unserved = all_unserved.copy()
                all_unserved[touch] = np.minimum(all_unserved[touch] + gaps, 1.0)

        def make(i: int) -> Candidate:
            return Candidate(job.job_id, kind, ranks_of(i), all_y[i], float(j_all[i]), float(all_p[i]), float(sw[i]),
                             float(sigma[i]), float(all_unserved[i]), float(all_served[i]), dem, float(all_cap[i]),
                             c3_ok=bool(all_p[i] <= knobs.tau))

        # the running ladder itself is the keep option, not a candidate
        same = np.zeros(F + H, dtype=bool)
        if current:
            cur_key = ladder_key(current)
            cur_pools = {r.pool_id for r in current}
            for i in range(F + H):
                if i < F and not (proto_cur[rows_p[i]] and len(current) == 1):
                    continue
                pools_i = {rows_pid[i]} if i < F else {r.pool_id for r in hetero[i - F]}
                if pools_i <= cur_pools and ladder_key(ranks_of(i)) == cur_key:
                    same[i] = True

        # 6. C3, late batch jobs; a single-pool ladder larger than its whole pool can never run
        # there (not even once every other job has left it): it is not an option, and it must not
        # take a candidate slot or a reservation from a ladder that fits
        fits = np.ones(F + H, dtype=bool)
        if F:
            fits[:F] = inst <= np.array([pl.total_instances for pl in rows_pool], dtype=float)
        if current and any(settling):  # a new rank is held for the settle window (split.sheds_settling)
            healthy = (keep_eval is not None and float(keep_eval.unserved[0]) <= 1e-3
                       and self._keep_risk(js, float(keep_eval.p_brk[0])) <= knobs.tau)
            fits &= ~sheds_settling(current, [ranks_of(i) for i in range(F + H)], settling, healthy=healthy)
        c3 = (all_p <= knobs.tau) & ~same & fits
        late = bool(not c3.any() and (~same & fits).any() and not online)
        eligible = (~same & fits) if late else c3
        # ... and repairs: a running ladder that breaches C3 may be left for any ladder that breaches
        # less (module docstring, "Repairs")
        repair_below = None
        repairs = np.zeros(F + H, dtype=bool)
        if current and keep_eval is not None and not late:
            kp0 = self._keep_risk(js, float(keep_eval.p_brk[0]))
            if kp0 > knobs.tau:
                repair_below = kp0
                repairs = (all_p > knobs.tau) & (all_p < kp0) & ~same & fits
                eligible = eligible | repairs
        kept_idx = self._prune_idx(np.flatnonzero(eligible), rows_pid, F, hetero, inst, sigma)
        kept = [make(i) for i in kept_idx]
        for c, i in zip(kept, kept_idx, strict=True):
            c.late = late
            c.repair = bool(repairs[i])

        keep_c = None
        if current and keep_eval is not None:
            kj = float(tchebycheff(keep_eval.y, weights, z, rng, knobs.rho)[0])
            # the running ladder's own last window outranks the model where it says worse
            kp = self._keep_risk(js, float(keep_eval.p_brk[0]))
            keep_c = Candidate(job.job_id, OptionKind.KEEP, current, keep_eval.y[0], kj, kp, 0.0,
                               kj - knobs.gamma * kp, float(keep_eval.unserved[0]), float(keep_eval.served_tps[0]),
                               dem, float(keep_eval.capacity_tps[0]), c3_ok=kp <= knobs.tau)
        defer_c = None
        if js.status is JobStatus.PENDING:
            defer_c = Candidate(job.job_id, OptionKind.DEFER, (), np.full(5, np.nan), 0.0, 0.0, 0.0, 0.0, 1.0, 0.0,
                                dem, 0.0)
        elif keep_c is None:
            # An active job whose ranks are all gone (reclaimed, failed to materialise): keeping
            # it means keeping nothing, which serves none of its demand. Without this option the
            # job would have no null choice and the selector could not leave it unplaced.
            keep_c = Candidate(job.job_id, OptionKind.KEEP, (), np.full(5, np.nan), 0.0, 0.0, 0.0, 0.0, 1.0, 0.0,
                               dem, 0.0)
        for c in [*kept, *([keep_c] if keep_c else [])]:
            c.activation = self.activation(js, c.ranks, model, sig)
            c.eig = ctx.exploration.eig(c.activation)
            c.mechanism_id = ctx.exploration.best_mechanism(c.activation)
        # untried ladders only: the running chains are judged on their evidence (causal_risk, choice 5)
        running_chains = {r.key for r in current} if current else set()
        if all_p_hi is not None and len(all_p_hi) == F + H:
            for c, i in zip(kept, kept_idx, strict=True):
                if not all(r.key in running_chains for r in c.ranks):
                    self._causal_risk(c, float(all_p_hi[i]))
        for c in [*kept, *(x for x in (keep_c, defer_c) if x is not None)]:
            c.cand_id = f"{job.job_id}#{c.kind.value}:{ladder_key(c.ranks) if c.ranks else '-'}"

        def build_all() -> list[Candidate]:
            out = []
            for i in np.flatnonzero(~same & fits):
                c = make(int(i))
                c.late = late
                c.repair = bool(repairs[i])
                c.cand_id = f"{job.job_id}#{c.kind.value}:{ladder_key(c.ranks)}"
                out.append(c)
            return out

        reasons: list[str] = []
        if not kept:
            if n_chains == 0:
                reasons.append("no chain of this model fits any GPU its budget allows, or none meets the p99 "
                               "targets at any load (C2)")
            elif F + H == 0:
                reasons.append("no feasible chain can be sized within the budget slice")
            else:
                reasons.append(f"all {int((~same).sum())} sized ladders exceed the breach threshold "
                               f"τ={knobs.tau} (C3)")
        return JobCandidates(
            state=js, slice=slice_, demand_tps=dem, candidates=kept, keep=keep_c, defer=defer_c, reference=ref,
            n_chains=n_chains, n_feasible=P, n_c3_dropped=int(((all_p > knobs.tau) & ~same).sum()),
            infeasible_reasons=reasons, late=late, repair_below=repair_below, scored_builder=build_all,
        )

    def _breaching(self, js: JobState, keep_eval) -> bool:  # noqa: ANN001
        """The running ladder breaches C3 (at ε, or by its own last window) or leaves demand unserved:
        the trigger for scale-out ladders (module docstring, "Scale-out")."""
        k = self._keep_risk(js, float(keep_eval.p_brk[0]))
        return k > self.ctx.knobs.tau or float(keep_eval.unserved[0]) > 0.0

    def _keep_risk(self, js: JobState, p_model: float) -> float:
        """The running ladder's breach probability: the model's, or its own last window's where that says
        worse (:mod:`koi.evidence.observed`)."""
        return max(p_model, float(self.ctx.observed_risk.get(js.job.job_id, 0.0)))

    def _causal_risk(self, c: Candidate, p_hi: float) -> None:
        """Move a candidate's DRO radius by its causal doubt (:mod:`koi.planning.causal_risk`), and σ's risk
        term with it (C3 unchanged)."""
        kappa = self.ctx.knobs.causal_risk
        x = self.ctx.exploration.doubt(c.activation, self.doubt_centre()) if kappa > 0 else 0.0
        p = widened(c.p_brk, p_hi, x, kappa)
        c.sigma -= self.ctx.knobs.gamma * (p - c.p_brk)
        c.p_brk = p

    def _prune_idx(self, idx: np.ndarray, rows_pid: list[str], F: int, hetero: list[tuple[RankSpec, ...]],
                   inst: np.ndarray, sigma: np.ndarray) -> list[int]:
        """Per pool, drop candidates that use at least as many instances for no better σ (dominated: in
        the same pool they compete for the same capacity); then keep the best σ of each pool, the smallest
        footprint of each pool, and fill to ``max_candidates`` by σ (ties by enumeration order:
        deterministic). Split ladders compete as one more group.

        Choice: EIG is not part of the dominance test — a dominated candidate that would test other edges
        is dropped; exploration chooses among the survivors.
        """
        if len(idx) == 0:
            return []
        by_pool: dict[str, list[int]] = defaultdict(list)
        multi: list[int] = []
        for i in idx.tolist():
            (by_pool[rows_pid[i]].append(i) if i < F else multi.append(i))

        def size(i: int) -> float:
            return float(inst[i]) if i < F else float(sum(r.instances for r in hetero[i - F]))

        survivors: list[int] = []
        smallest: dict[str, int] = {}
        best_of: dict[str, int] = {}
        prune = self.ctx.enum.prune_dominated
        for pid in sorted(by_pool):
            group = sorted(by_pool[pid], key=lambda i: (size(i), -sigma[i], i))
            smallest[pid] = group[0]
            best = -math.inf
            for i in group:
                if not prune or sigma[i] > best + 1e-12:
                    survivors.append(i)
                    best = max(best, sigma[i])
            best_of[pid] = max(by_pool[pid], key=lambda i: (sigma[i], -i))
        survivors += multi
        k = self.ctx.enum.max_candidates
        chosen: list[int] = []
        taken: set[int] = set()
        for pid in sorted(best_of, key=lambda p: (-sigma[best_of[p]], p)):
            if len(chosen) < k and best_of[pid] not in taken:
                chosen.append(best_of[pid])
                taken.add(best_of[pid])
        if multi and len(chosen) < k:
            m = max(multi, key=lambda i: (sigma[i], -i))
            chosen.append(m)
            taken.add(m)
        for pid in sorted(smallest):
            if len(chosen) < k and smallest[pid] not in taken:
                chosen.append(smallest[pid])
                taken.add(smallest[pid])
        for i in sorted(survivors, key=lambda i: (-sigma[i], i)):
            if len(chosen) >= k:
                break
            if i not in taken:
                chosen.append(i)
                taken.add(i)
        return sorted(chosen, key=lambda i: (-sigma[i], i))


def generate(snapshot: ClusterSnapshot, ctx: PlanningContext, book=None) -> dict[str, JobCandidates]:  # noqa: ANN001
    """Candidates for every pending and active job, in the budget book's priority order."""
    from koi.planning.budget import build_budget_book

    book = book or build_budget_book(snapshot)
    gen = CandidateGenerator(snapshot, ctx)
    out: dict[str, JobCandidates] = {}
    for jid in book.priority_table:
        out[jid] = gen.for_job(snapshot.job(jid), book.slice(jid))
    return out
