"""The benchmark scenarios of issue 8: they load, meet the issue's brief, and equal the generator's output."""

from __future__ import annotations

import pytest
import yaml

from koi import catalog
from koi.bench import scenario_gen as gen
from koi.domain import ArrivalProcess, JobClass, Market
from koi.sim import load_scenario
from koi.sim.driver import derive_deploy

HETERO = ("hetero-3h", "hetero-12h")
GPUS = {"hetero-3h": 400, "hetero-12h": 800, "homo-12h": 400}


@pytest.fixture(scope="module", params=gen.NAMES)
def shipped(request):
    name = request.param
    return name, load_scenario(gen.path(name))


def test_the_three_scenarios_ship():
    assert set(gen.NAMES) == {"hetero-3h", "hetero-12h", "homo-12h"}
    for name in gen.NAMES:
        assert gen.path(name).is_file(), name


@pytest.mark.parametrize("name", gen.NAMES)
def test_shipped_yaml_equals_the_generators_output(name):
    text = gen.path(name).read_text(encoding="utf-8")
    assert text == gen.render(name), f"{name}.yaml is stale: run python -m koi.bench.scenario_gen"
    assert yaml.safe_load(text) == gen.scenario(name)


def test_generator_check_mode_and_deterministic_writes(tmp_path):
    assert gen.main(["--check"]) == 0
    assert gen.stale() == []
    written = gen.write_all(tmp_path)
    assert [p.name for p in written] == [f"{n}.yaml" for n in gen.NAMES]
    for p, name in zip(written, gen.NAMES, strict=True):
        assert p.read_text(encoding="utf-8") == gen.path(name).read_text(encoding="utf-8")


def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="unknown benchmark scenario"):
        gen.scenario("hetero-1h")


def test_fleet(shipped):
    name, sc = shipped
    assert sc.total_gpus == GPUS[name]
    assert len({p.cloud for p in sc.pools}) >= 3
    assert len({(p.cloud, p.region) for p in sc.pools}) >= 3
    assert {p.market for p in sc.pools} == {Market.RESERVED, Market.ON_DEMAND, Market.SPOT}
    gpu_types = {sc.instance_type(p).gpu_type for p in sc.pools}
    if name in HETERO:
        assert len(gpu_types) >= 5
    else:
        assert gpu_types == {"H100"}
    # spot pools carry a reclaim hazard; a spot reclaim is also scheduled
    assert all(p.reclaim_rate_per_hour > 0 for p in sc.pools if p.market is Market.SPOT)
    assert any(
        e.kind == "spot_reclaim" and sc.pools[sc.pool_index(e.pool)].market is Market.SPOT for e in sc.events
    )
    # a replica that fails to materialize
    assert any(sc.lifecycle_of(p).materialize_fail_prob > 0 for p in sc.pools)


def test_first_fit_trap_pools_list_the_best_gpus_first(shipped):
    name, sc = shipped
    if name not in HETERO:
        return
    first = [sc.instance_type(p).gpu_type for p in sc.pools[:3]]
    assert first == ["H100", "H100", "H100"]


def test_jobs_and_models(shipped):
    _name, sc = shipped
    jobs = [j.job for j in sc.jobs]
    assert len(jobs) == 25
    assert all(j.deploy is None for j in sc.jobs), "placement is the planner's job: no deploy sections"
    models = [catalog.model(name) for name in sorted({j.model for j in jobs})]
    assert len(models) >= 10
    assert min(m.params_b for m in models) <= 2.0
    assert max(m.params_b for m in models) >= 200.0
    assert sum(1 for m in models if m.num_experts > 0) >= 2
    assert any(m.num_experts == 0 and m.params_b >= 70 for m in models)  # a large dense model too


def test_batch_jobs(shipped):
    _name, sc = shipped
    batch = sc.batch_jobs
    assert len(batch) == 6
    for j in batch:
        assert 20 * 60 <= j.slo.deadline_s <= 135 * 60, j.job_id
        assert j.deadline_at <= sc.duration_s, f"{j.job_id}: deadline outside the horizon"
    assert {j.slo.deadline_s for j in batch} >= {20 * 60.0, 135 * 60.0}
    # the paper's 7,200-request Llama-70B campaign, in every scenario
    summ = next(j for j in batch if j.job_id == "batch-summ-70b")
    assert summ.model == "llama-3.1-70b" and summ.slo.num_requests == 7200 and summ.slo.deadline_s == 8100


def test_workload_mix(shipped):
    _name, sc = shipped
    online = sc.online_jobs
    assert len(online) == 19
    procs = {j.workload.arrival.process for j in online}
    assert procs == {ArrivalProcess.POISSON, ArrivalProcess.CONSTANT, ArrivalProcess.GAMMA}
    for j in online:
        if j.workload.arrival.process is ArrivalProcess.GAMMA:
            assert 1.5 <= j.workload.arrival.cv <= 3.0, j.job_id
    kinds = {j.workload.kind for j in online}
    assert {"moderation", "chat", "code", "rag", "summarization", "agentic"} <= kinds
    assert any(j.workload.input_len.max >= 24000 for j in sc.online_jobs + sc.batch_jobs), (
        "a 24K-input workload"
    )
    assert any(j.workload.shared_prefix_fraction > 0 and j.workload.kind == "rag" for j in online)


SLO_RANGES = {  # kind: (p99 TTFT ms range, p99 TPOT ms range), from the issue
    "moderation": ((300, 500), (30, 50)),
    "chat": ((1000, 2000), (50, 100)),
    "code": ((1500, 1500), (60, 60)),
    "rag": ((2000, 4000), (80, 80)),
    "summarization": ((5000, 10000), (50, 100)),
    "agentic": ((1000, 5000), (40, 60)),
}


def test_slos_are_realistic_per_kind(shipped):
    _name, sc = shipped
    for j in sc.online_jobs:
        (t_lo, t_hi), (p_lo, p_hi) = SLO_RANGES[j.workload.kind]
        assert t_lo <= j.slo.p99_ttft_ms <= t_hi, j.job_id
        assert p_lo <= j.slo.p99_tpot_ms <= p_hi, j.job_id


def test_jobs_arrive_and_leave(shipped):
    name, sc = shipped
    jobs = [j.job for j in sc.jobs]
    late = [j for j in jobs if j.submitted_at > 0]
    assert len(late) >= 8
    leaving = [j for j in sc.online_jobs if j.lifetime_s is not None]
    assert len(leaving) >= 4
    assert all(j.submitted_at + j.lifetime_s <= sc.duration_s for j in leaving)
    if name == "hetero-3h":
        assert all(j.submitted_at <= sc.duration_s / 2 for j in jobs), "arrivals over the first half"
    else:  # the 12-hour runs keep jobs arriving and leaving over the whole horizon
        assert any(j.submitted_at >= 0.75 * sc.duration_s for j in jobs)
        assert any(j.submitted_at >= 0.75 * sc.duration_s for j in sc.batch_jobs)
        assert any(j.submitted_at + j.lifetime_s >= 0.75 * sc.duration_s for j in leaving)


def test_hidden_effects(shipped):
    name, sc = shipped
    by_kind = {}
    for h in sc.hidden:
        by_kind.setdefault(h.kind, []).append(h)
    changes = by_kind["engine_change"]
    assert any(h.applies_to == "all" and 0 < h.start_s < sc.duration_s for h in changes)
    assert all(0.7 <= h.throughput_factor <= 1.3 for h in changes)
    # one cloud's virtualisation is 10-20% slower
    assert any(h.match.cloud and 1.1 <= h.step_time_factor <= 1.2 for h in by_kind["efficiency"])
    assert any(h.jitter_cv > 0 for h in by_kind["noisy_neighbours"])
    ic = by_kind["interconnect"]
    assert ic and all(h.comm_factor > 1 for h in ic)
    if name in HETERO:  # the interconnect effect sits on a PCIe pool
        pcie = {
            sc.instance_type(p).name for p in sc.pools if sc.instance_type(p).interconnect.value == "pcie"
        }
        assert any(h.match.instance_type in pcie for h in ic)
    for h in sc.hidden:  # every effect touches at least one pool of the fleet
        envs = [(p, sc.instance_type(p)) for p in sc.pools]
        assert any(
            (h.match.cloud in (None, p.cloud)) and (h.match.market in (None, p.market))
            and (h.match.gpu_type in (None, it.gpu_type)) and (h.match.instance_type in (None, it.name))
            for p, it in envs
        ), h  # fmt: skip


def test_every_job_is_placeable_somewhere(shipped):
    _name, sc = shipped
    for j in sc.jobs:
        assert derive_deploy(sc, j.job), f"{j.job.job_id} fits no pool of the fleet"


def test_load_is_sized_to_the_fleet(shipped):
    """Requested output tokens/s per GPU, a sanity band around the calibration in the README
    (an all-H100 fleet serves about twice what the mixed fleet's average GPU does)."""
    name, sc = shipped
    horizon = sc.duration_s
    tok = 0.0
    for j in sc.jobs:
        job = j.job
        if job.job_class is JobClass.ONLINE:
            end = horizon if job.lifetime_s is None else job.submitted_at + job.lifetime_s
            tok += job.workload.arrival.rate_rps * (end - job.submitted_at) * job.workload.osl
        else:
            tok += job.slo.num_requests * job.workload.osl
    per_gpu = tok / horizon / sc.total_gpus
    lo, hi = (80, 200) if name in HETERO else (160, 400)
    assert lo <= per_gpu <= hi, f"{name}: {per_gpu:.0f} output tok/s per GPU demanded"
