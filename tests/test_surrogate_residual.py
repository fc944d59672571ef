"""Residual learning: a pure function of PerfDB records; multiplicative corrections with shrinkage,
applied only inside the scope they were learned on; prequential residual histories for the DRO band."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain import ChainConfig, Environment, Job, Rank
from koi.store import PerfRecord
from koi.surrogate import ResidualModel, Scope, Surrogate


def env(gpu: str = "H100", zone: str = "us-east-1a") -> Environment:
    return Environment(cloud="aws", region="us-east-1", zone=zone, market="on_demand", gpu_type=gpu)


def job(rate: float = 4.0, job_id: str = "j") -> Job:
    return Job(
        job_id=job_id,
        model="llama-3.1-8b",
        job_class="online",
        slo={"p99_ttft_ms": 2000.0, "p99_tpot_ms": 100.0},
        workload={
            "input_len": {"kind": "lognormal", "mean": 1024, "std": 256, "min": 1, "max": 4096},
            "output_len": {"kind": "lognormal", "mean": 256, "std": 64, "min": 1, "max": 1024},
            "arrival": {"process": "poisson", "rate_rps": rate},
        },
    )


H100_RANK = Rank(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"), n_replicas=1)
A100_RANK = Rank(
    env=Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="A100-80GB"),
    config=ChainConfig(tp=1, instance_type="p4de.24xlarge"),
    n_replicas=1,
)


def biased_records(n: int, bias: float = 1.3, rank: Rank = H100_RANK) -> list[PerfRecord]:
    """Records whose observed TPOT/TTFT are ``bias`` × the base prediction (plus ±2% noise)."""
    s = Surrogate()
    rng = np.random.default_rng(0)
    out = []
    for t in range(n):
        rate = 2.0 + 4.0 * rng.random()
        p = s.predict_rank(job(rate), rank, offered_rps=rate)
        noise = float(np.exp(rng.normal(0, 0.02)))
        obs_y = {
            "p99_tpot_ms": p.base_values["p99_tpot_ms"] * bias * noise,
            "p99_ttft_ms": p.base_values["p99_ttft_ms"] * bias * noise,
            "throughput_tokens_per_sec": p.base_values["throughput_tokens_per_sec"],
            "cost_per_token": p.base_values["cost_per_token"],
            "slo_margin": p.base_values["slo_margin"] - 0.05,
        }
        obs_v = {"live_batch_size": p.base_values["live_batch_size"] * bias}
        out.append(
            PerfRecord.of("c", t, job(rate), rank, observed_v=obs_v, observed_y=obs_y, predicted=p.base_values)
        )
    return out


def scope_of(rank: Rank, j: Job | None = None) -> Scope:
    j = j or job()
    return Scope.of(
        env_id=rank.env.env_id, gpu_type=rank.env.gpu_type, model="llama-3.1-8b", family="llama3",
        tp=rank.config.tp, pp=rank.config.pp, weight_dtype="bf16", engine="vllm", isl=j.workload.isl, osl=j.workload.osl,
    )  # fmt: skip


@pytest.fixture(scope="module")
def records() -> list[PerfRecord]:
    return biased_records(20)


def corrected(s: Surrogate, rank: Rank, rate: float, job_id: str = "j"):
    return s.predict_rank(job(rate, job_id), rank, offered_rps=rate)


def test_correction_converges_on_a_constructed_bias(records):
    s = Surrogate.from_records(records)
    for rate in (2.5, 4.5):  # loads inside the range the records came from
        p = corrected(s, H100_RANK, rate)
        assert p.values["p99_tpot_ms"] == pytest.approx(1.3 * p.base_values["p99_tpot_ms"], rel=0.04)
        assert p.values["p99_ttft_ms"] == pytest.approx(1.3 * p.base_values["p99_ttft_ms"], rel=0.06)
    # a slower world was learned (speed > 1) and throughput stays the offered rate
    assert s.residuals.speed(scope_of(H100_RANK)) > 1.05
    assert p.values["throughput_tokens_per_sec"] == pytest.approx(p.base_values["throughput_tokens_per_sec"], rel=0.01)
    assert p.residual_support == 20


def test_shrinkage_grows_with_the_record_count():
    def gap(n: int) -> float:
        p = corrected(Surrogate.from_records(biased_records(n)), H100_RANK, 3.0)
        return abs(p.values["p99_tpot_ms"] / p.base_values["p99_tpot_ms"] - 1.3)

    few, many = gap(2), gap(20)
    assert many < few < 0.3


def test_a_speed_difference_is_learned_in_the_physics_and_transfers_across_loads():
    """Observations from a world whose iterations are 1.2x slower, at light and moderate load,
    predict that world at a heavier load too (where a ratio learned at light load would not)."""
    s0 = Surrogate()
    sat = s0.rank_capacity(job(), H100_RANK.chain).saturation_rps
    recs = []
    for t, rho in enumerate(np.linspace(0.1, 0.5, 10)):
        rate = rho * sat
        truth = s0.predict_many(job(rate), [H100_RANK.chain], offered_rps=rate, speed=1.2).rank(0)
        base = s0.predict_rank(job(rate), H100_RANK, offered_rps=rate)
        recs.append(PerfRecord.of("c", t, job(rate), H100_RANK, observed_v={}, predicted=base.base_values,
                                  observed_y={k: truth.values[k] for k in ("p99_tpot_ms", "p99_ttft_ms",
                                                                          "throughput_tokens_per_sec")}))  # fmt: skip
    s = Surrogate.from_records(recs)
    assert s.residuals.speed(scope_of(H100_RANK)) == pytest.approx(1.2, rel=0.06)
    heavy = 0.75 * sat / 1.2
    truth = s0.predict_many(job(heavy), [H100_RANK.chain], offered_rps=heavy, speed=1.2).rank(0)
    pred = corrected(s, H100_RANK, heavy)
    assert pred.values["p99_tpot_ms"] == pytest.approx(truth.values["p99_tpot_ms"], rel=0.08)
    assert pred.values["p99_ttft_ms"] == pytest.approx(truth.values["p99_ttft_ms"], rel=0.15)
    # and the learned slowdown lowers the capacity the planner sizes with
    assert s.rank_capacity(job(), H100_RANK.chain).saturation_rps < 0.9 * sat


def test_predict_record_is_the_planners_corrected_prediction_at_the_records_load():
    """What the slow loop's band check compares an outcome with (koi.calibration.coverage): the physics
    re-run at the learned speed and the record's served rate, not the base scaled by the speed (which
    misses how a slower GPU's latencies grow with load)."""
    s0 = Surrogate()
    sat = s0.rank_capacity(job(), H100_RANK.chain).saturation_rps

    def record(t: int, rate: float) -> PerfRecord:
        truth = s0.predict_many(job(rate), [H100_RANK.chain], offered_rps=rate, speed=1.2).rank(0)
        base = s0.predict_rank(job(rate), H100_RANK, offered_rps=rate)
        return PerfRecord.of("c", t, job(rate), H100_RANK, observed_v={}, predicted=base.base_values,
                             observed_y={k: truth.values[k] for k in ("p99_tpot_ms", "p99_ttft_ms")})

    fitted = Surrogate.from_records([record(t, rho * sat) for t, rho in enumerate(np.linspace(0.1, 0.5, 10))])
    rec = record(99, 0.7 * sat / 1.2)
    got = fitted.residuals.predict_record(rec, ["p99_ttft_ms", "p99_tpot_ms"])
    no_ttft = rec.model_copy(update={"predicted": {k: v for k, v in rec.predicted.items() if k != "p99_ttft_ms"}})
    assert set(fitted.residuals.predict_record(no_ttft, ["p99_ttft_ms", "p99_tpot_ms"])) == {"p99_tpot_ms"}
    first_order = fitted.residuals.correct_values(rec.predicted, scope_of(H100_RANK))
    for q in ("p99_ttft_ms", "p99_tpot_ms"):
        assert got[q] == pytest.approx(rec.observed_y[q], rel=0.04)
        assert abs(first_order[q] / rec.observed_y[q] - 1) > 0.1
    assert ResidualModel.empty().predict_record(rec, ["p99_tpot_ms"]) == {"p99_tpot_ms": rec.predicted["p99_tpot_ms"]}


def test_correction_is_not_applied_outside_its_scope(records):
    s = Surrogate.from_records(records)
    q = corrected(s, A100_RANK, 3.0, job_id="another-job")
    assert q.values["p99_tpot_ms"] == pytest.approx(q.base_values["p99_tpot_ms"])  # another GPU and job: nothing
    # the same job on another GPU: only the job's shrunk share (its traffic follows it), less than on the H100
    same_job = corrected(s, A100_RANK, 3.0)
    on_h100 = corrected(s, H100_RANK, 3.0)
    ratio = same_job.values["p99_tpot_ms"] / same_job.base_values["p99_tpot_ms"]
    assert 1.0 < ratio < on_h100.values["p99_tpot_ms"] / on_h100.base_values["p99_tpot_ms"]
    assert s.residuals.speed(scope_of(A100_RANK)) == 1.0
    inside = s.residuals.speed(scope_of(H100_RANK))
    # the same scope (GPU × family × TP/PP × shape) in another zone: corrected, without the env/fine effects
    other_zone = Rank(env=env(zone="us-east-1b"), config=H100_RANK.config, n_replicas=1)
    f_zone = s.residuals.speed(scope_of(other_zone))
    assert 1.0 < f_zone < inside
    # another parallelism on the same GPU in another zone: only the strongly shrunk GPU-wide effect
    tp2 = Rank(env=env(zone="us-east-1b"), config=ChainConfig(tp=2, instance_type="p5.48xlarge"), n_replicas=1)
    assert 1.0 < s.residuals.speed(scope_of(tp2)) < f_zone


def test_correct_on_a_prediction_is_first_order_in_speed(records):
    m = ResidualModel.fit(records)
    p = Surrogate().predict_rank(job(3.0), H100_RANK, offered_rps=3.0)
    c = m.correct(p)
    f = m.speed(p.scope) * m.factor("p99_tpot_ms", p.scope)
    assert c.values["p99_tpot_ms"] == pytest.approx(p.values["p99_tpot_ms"] * f)
    assert c.base_values == p.base_values


def test_residual_history_is_prequential_and_relative(records):
    m = ResidualModel.fit(records)
    r = m.residuals("p99_tpot_ms", scope_of(H100_RANK))
    assert len(r) == 20
    # the first record is predicted with no correction: its residual is the full bias
    assert r[0] == pytest.approx(0.3, abs=0.05)
    # later records are predicted by the model fitted on the earlier ones: small residuals
    assert np.median(np.abs(r[-5:])) < 0.05
    # in objective units
    u = m.residuals_in_units("p99_tpot_ms", scope_of(H100_RANK), 10.0)
    assert u == pytest.approx(r * 10.0)
    # slo margin residuals are absolute
    assert m.residuals("slo_margin", scope_of(H100_RANK)) == pytest.approx(np.full(20, -0.05))
    # no history outside the GPU
    assert len(m.residuals("p99_tpot_ms", scope_of(A100_RANK))) == 20  # backs off to all records
    assert len(ResidualModel.fit(records[:3]).residuals("p99_tpot_ms", scope_of(A100_RANK))) == 0


def test_fit_is_a_pure_function_of_the_records(records):
    a = ResidualModel.fit(records)
    b = ResidualModel.fit(list(records))
    assert a.speed(scope_of(H100_RANK)) == b.speed(scope_of(H100_RANK))
    assert a.factor("p99_tpot_ms", scope_of(H100_RANK)) == b.factor("p99_tpot_ms", scope_of(H100_RANK))
    assert np.array_equal(a.residuals("p99_tpot_ms"), b.residuals("p99_tpot_ms"))
    assert ResidualModel.fit([]).factor("p99_tpot_ms", scope_of(H100_RANK)) == 1.0


def test_records_without_a_base_prediction_are_skipped_or_repredicted(records):
    bare = [r.model_copy(update={"predicted": {}}) for r in records]
    assert ResidualModel.fit(bare).n_records == 0
    m = ResidualModel.fit(bare, predictor=lambda r: records[r.tick].predicted)
    ref = ResidualModel.fit(records)
    assert m.n_records == 20
    assert m.speed(scope_of(H100_RANK)) == pytest.approx(ref.speed(scope_of(H100_RANK)))


def test_uncertainty_shrinks_with_residual_support():
    rank = Rank(env=Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="A10G"),
                config=ChainConfig(tp=1, instance_type="g5.xlarge"), n_replicas=1)  # fmt: skip
    before = Surrogate().predict_rank(job(1.0), rank, offered_rps=1.0)
    after = Surrogate.from_records(biased_records(20, rank=rank)).predict_rank(job(1.0), rank, offered_rps=1.0)
    assert before.uncertainty > after.uncertainty > 1.0


def test_prequential_blocks_are_stable_as_the_perfdb_grows_and_kept_fits_change_nothing(monkeypatch):
    """The history of a PerfDB that grew by a tick equals a fit from scratch (no kept prefix fits),
    and it fits only the blocks that are new: every earlier boundary is shared."""
    from koi.surrogate import residual

    recs = biased_records(60)
    assert residual._block_bounds(60, None)[:4] == [0, 8, 16, 24]
    assert set(residual._block_bounds(50, None)) - {50} <= set(residual._block_bounds(60, None))
    assert residual._block_bounds(10, 4) == [0, 4, 8, 10]
    residual._PREFIX_FITS.clear()
    calls = []
    real = ResidualModel._fit_stage
    monkeypatch.setattr(ResidualModel, "_fit_stage", staticmethod(lambda *a: calls.append(len(a[0])) or real(*a)))
    ResidualModel.fit(recs[:50])
    calls.clear()
    grown = ResidualModel.fit(recs)
    prequential_fits = [n for n in calls if n < 60]  # the full fit (60 rows) is not a prefix fit
    assert prequential_fits == [b for b in residual._block_bounds(60, None)[1:-1] if b >= 50]
    residual._PREFIX_FITS.clear()
    fresh = ResidualModel.fit(recs)
    for q in ("p99_tpot_ms", "p99_ttft_ms", "slo_margin"):
        assert np.array_equal(grown.residuals(q), fresh.residuals(q))
    # a changed early record changes every later prefix: nothing stale is reused
    y0 = recs[0].observed_y
    changed = [recs[0].model_copy(update={"observed_y": {**y0, "p99_ttft_ms": y0["p99_ttft_ms"] * 1.01}}), *recs[1:]]
    calls.clear()
    ResidualModel.fit(changed)
    assert [n for n in calls if n < 60] == residual._block_bounds(60, None)[1:-1]


def test_factor_row_is_every_factor_of_the_scope_in_effect_order(records):
    """The planner's one-lookup-per-scope path gives exactly the per-quantity factors (memoized or not)."""
    from koi.planning.surrogate_adapter import memo_residuals

    m = ResidualModel.fit(records)
    memo = memo_residuals(m)
    for rank in (H100_RANK, A100_RANK):
        sc = scope_of(rank)
        for skip in ((), ("gpu",)):
            want = tuple(m.factor(q, sc, skip) for q in m.effects)
            assert m.factor_row(sc, skip) == want
            assert memo.factor_row(sc, skip) == want == memo.factor_row(sc, skip)
            twin = sc.model_copy()  # an equal scope, another object: served by the effect-key memo
            assert twin is not sc and memo.factor_row(twin, skip) == want
            assert memo.speed(twin, skip) == m.speed(sc, skip) and memo.support(twin) == m.support(sc)
        other = scope_of(A100_RANK if rank is H100_RANK else H100_RANK)
        assert memo.factor_row(other) == m.factor_row(other)  # keys differ: not the first scope's entry
    assert any(abs(f - 1.0) > 1e-3 for f in m.factor_row(scope_of(H100_RANK)))  # something was learned
    assert ResidualModel.fit([]).factor_row(scope_of(H100_RANK)) == ()


def test_the_joint_coded_fit_equals_one_fit_per_quantity(records):
    """Each fit stage encodes the rows' levels once and fits the quantities observed on the same records
    together; every learned value is exactly what one plain ridge backfit per quantity gives."""
    import math

    from koi.surrogate import residual as R
    from koi.surrogate.scope import EFFECTS, effect_keys

    mixed = records + biased_records(12, bias=0.8, rank=A100_RANK)
    for i, r in enumerate(mixed[::3]):  # some records without a throughput: another subset of rows
        mixed[3 * i] = r.model_copy(update={"observed_y": {k: v for k, v in r.observed_y.items()
                                                           if k != "throughput_tokens_per_sec"}})
    rows = [R._Row(r.config.engine_name, R.scope_of_record(r), dict(r.predicted), {**r.observed_v, **r.observed_y},
                   R._ratio_curves(cv), int(r.tick)) for r, cv in zip(mixed, R.physics_curves(mixed), strict=True)]
    y_speed, ok = R.ResidualModel._speed_targets(rows)
    speed, effects = R.ResidualModel._fit_stage(rows, y_speed, ok)

    def reference_fit(ix, y, prior_scale=1.0):  # noqa: ANN001, ANN202
        """One plain ridge backfit of one quantity on the string keys of its records."""
        ks = [effect_keys(rows[i].scope) for i in ix]
        idx, levels = {}, {}
        for j, e in enumerate(EFFECTS):
            uniq, inv = np.unique(np.asarray([k[j] for k in ks], dtype=object), return_inverse=True)
            idx[e], levels[e] = inv.astype(np.intp).ravel(), [str(u) for u in uniq]
        n_per = {e: np.bincount(idx[e], minlength=len(levels[e])).astype(float) for e in EFFECTS}
        theta = {e: np.zeros(len(levels[e])) for e in EFFECTS}
        for _ in range(R.BACKFIT_ITERS):
            for e in EFFECTS:
                partial = y - sum(theta[o][idx[o]] for o in EFFECTS if o != e)
                theta[e] = np.bincount(idx[e], weights=partial, minlength=len(levels[e])) / (
                    n_per[e] + R.PRIOR_STRENGTH[e] * prior_scale)
        return R._Effects(
            theta={e: dict(zip(levels[e], theta[e].tolist(), strict=True)) for e in EFFECTS},
            counts={e: dict(zip(levels[e], n_per[e].astype(int).tolist(), strict=True)) for e in EFFECTS})

    sel = np.flatnonzero(ok)
    ref_speed = reference_fit(sel, y_speed[sel])
    assert speed == ref_speed
    logf = [ref_speed.log_factor(r.scope) for r in rows]
    n_subsets = set()
    for q in R.CORRECTED:
        ix, ys = [], []
        for i, row in enumerate(rows):
            o, b = row.observed.get(q, 0.0), row.predicted.get(q, 0.0)
            if o > 1e-9 and b > 1e-9 and math.isfinite(o) and math.isfinite(b):
                pred = b * R._at(row.curve.get(q), logf[i])
                if pred > 1e-9:
                    ix.append(i)
                    ys.append(math.log(o / pred))
        if ix:
            n_subsets.add(tuple(ix))
            ref = reference_fit(ix, np.clip(np.array(ys), -R.OUTPUT_CLIP, R.OUTPUT_CLIP), R.OUTPUT_PRIOR_SCALE)
            assert effects[q] == ref, q
        else:
            assert q not in effects
    assert len(n_subsets) >= 2 and len(effects) >= 4


def test_a_quantity_the_physics_predicts_none_of_at_the_fitted_speed_is_skipped_not_divided_by():
    # hetero-12h, Koi seed 1: a rank observed preempting (1.5/s) where the base physics predicted 2e-7/s
    # ran 14% faster than the tables, and at that speed the physics predicts no preemption at all. The
    # prequential residual divided by that zero and every S4 from tick 99 on fell back to keep-all.
    from koi.surrogate.residual import SPEED_GRID, physics_curves

    recs = []
    for r in biased_records(12, bias=0.7):  # observed TPOT 0.7 × the tables: a faster part, log f < 0
        obs_v = {**r.observed_v, "preemption_rate": 1.5}
        pred = {**r.predicted, "preemption_rate": 2e-7}
        recs.append(r.model_copy(update={"observed_v": obs_v, "predicted": pred}))

    def curves(records):
        out = physics_curves(records)
        for c in out:
            c["preemption_rate"] = np.where(SPEED_GRID < 1.0, 0.0, 1.0)  # none preempted when faster
        return out

    m = ResidualModel.fit(recs, curves=curves)
    assert m.speed_effects is not None
    assert len(m.residuals("p99_tpot_ms", scope_of(H100_RANK))) == 12
    assert np.all(np.isfinite(m.residuals("preemption_rate", scope_of(H100_RANK))))


def test_an_unseen_chain_is_sized_under_its_tpot_target_and_a_seen_one_to_it(records):
    """Capacity: a chain with no record in its fine scope must predict p99 TPOT ≤ the margin × target
    (a cold surrogate: every chain); one the PerfDB has run is sized to the target itself."""
    from koi.surrogate.capacity_mixin import UNSEEN_TPOT_MARGIN

    def tight(target: float) -> Job:  # the same workload (the same fine scope), a TPOT target that binds
        return Job.model_validate({**job().model_dump(), "slo": {"p99_ttft_ms": 60_000.0, "p99_tpot_ms": target}})

    def tpot_at_capacity(s: Surrogate, rank: Rank, j: Job) -> tuple[float, float, str]:
        c = s.rank_capacity(j, rank.chain)
        p = s.predict_rank(j, Rank(env=rank.env, config=rank.config, n_replicas=1), offered_rps=c.rps)
        return c.rps, p.values["p99_tpot_ms"], c.limited_by

    cold = Surrogate()
    sat = cold.rank_capacity(job(), H100_RANK.chain).saturation_rps
    mid = cold.predict_rank(job(), H100_RANK, offered_rps=0.5 * sat).values["p99_tpot_ms"]
    j = tight(mid)
    rps, tpot, limit = tpot_at_capacity(cold, H100_RANK, j)
    assert limit == "p99_tpot_ms" and rps > 0
    assert UNSEEN_TPOT_MARGIN * mid * 0.97 <= tpot <= UNSEEN_TPOT_MARGIN * mid * 1.01
    no_margin = Surrogate(unseen_tpot_margin=1.0)
    rps1, tpot1, _ = tpot_at_capacity(no_margin, H100_RANK, j)
    assert rps1 > rps and mid * 0.97 <= tpot1 <= mid * 1.01

    fitted = Surrogate.from_records(records)  # records on H100_RANK's own fine scope (TPOT 1.3x the physics)
    assert fitted.residuals.support(scope_of(H100_RANK)) > 0
    _, seen_tpot, _ = tpot_at_capacity(fitted, H100_RANK, j)
    assert mid * 0.97 <= seen_tpot <= mid * 1.01  # its own correction: sized to the target
    other_zone = Rank(env=env(zone="us-east-1b"), config=H100_RANK.config, n_replicas=1)
    assert fitted.residuals.support(scope_of(other_zone)) == 0
    _, unseen_tpot, _ = tpot_at_capacity(fitted, other_zone, j)  # a borrowed correction: the margin
    assert UNSEEN_TPOT_MARGIN * mid * 0.97 <= unseen_tpot <= UNSEEN_TPOT_MARGIN * mid * 1.01
    with pytest.raises(ValueError, match="unseen_tpot_margin"):
        Surrogate(unseen_tpot_margin=0.0)
