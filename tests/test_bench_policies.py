"""The benchmark's policies (issue 8) through the tick pipeline on a tiny simulated cluster.

One small scenario (four pools on two clouds, three jobs, one arriving late; every kind of hidden
effect), an in-process world per run, the runner's Runtime shape (the policy's proposer; S2/S3
no-ops unless the policy runs them). Runs are shared between tests (module scope).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from koi.bench.policy import BenchContext, Family, all_policies, get_policy
from koi.domain import ActionType, Chain, ChainConfig, ClusterSnapshot, Environment, Job, Market
from koi.pipeline import InProcessWorldProvider, Runtime, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.pipeline.runtime import ProposeContext
from koi.sim.scenario import parse_scenario
from koi.sim.world import World
from koi.store import (
    Stage,
    get_plan,
    get_plan_row,
    init_db,
    list_stage_outputs,
    load_stage_model,
    make_engine,
    query_perf,
    session_scope,
)

LN = {"kind": "lognormal"}

SCENARIO = {
    "name": "policies-tiny",
    "seed": 5,
    "duration_s": 1800,
    "sample_s": 30,
    "lifecycle": {"provision_s": 30, "load_gbps": 4.0, "warmup_s": 10},
    "pools": [
        {"name": "aws-h100", "cloud": "aws", "region": "us-east-1", "zone": "us-east-1a", "market": "on_demand",
         "instance_type": "p5.48xlarge", "instances": 1},
        {"name": "aws-l40s-spot", "cloud": "aws", "region": "us-east-1", "zone": "us-east-1b", "market": "spot",
         "instance_type": "g6e.12xlarge", "instances": 2},
        {"name": "gcp-l4-spot", "cloud": "gcp", "region": "us-central1", "zone": "us-central1-c", "market": "spot",
         "instance_type": "g2-standard-48", "instances": 1},
        {"name": "gcp-a100", "cloud": "gcp", "region": "us-central1", "zone": "us-central1-b", "market": "on_demand",
         "instance_type": "a2-ultragpu-4g", "instances": 1},
    ],
    "hidden": [
        {"kind": "efficiency", "match": {"cloud": "gcp", "gpu_type": "L4"}, "step_time_factor": 1.15},
        {"kind": "noisy_neighbours", "match": {"cloud": "aws", "market": "spot"}, "step_time_factor": 1.05,
         "jitter_cv": 0.1},
        {"kind": "engine_change", "match": {"cloud": "aws", "gpu_type": "H100"}, "start_s": 450,
         "throughput_factor": 0.8},
        {"kind": "interconnect", "match": {"cloud": "gcp", "gpu_type": "A100-80GB"}, "comm_factor": 1.6},
    ],
    "jobs": [
        {"job_id": "chat-8b", "model": "llama-3.1-8b", "job_class": "online",
         "workload": {"kind": "chat", "input_len": {**LN, "mean": 800, "std": 400, "min": 16, "max": 4096},
                      "output_len": {**LN, "mean": 200, "std": 100, "min": 8, "max": 1024},
                      "arrival": {"process": "poisson", "rate_rps": 4}},
         "slo": {"p99_ttft_ms": 1500, "p99_tpot_ms": 80}},
        {"job_id": "moderation", "model": "llama-3.2-1b", "job_class": "online",
         "workload": {"kind": "moderation", "input_len": {"kind": "normal", "mean": 300, "std": 80, "min": 32,
                                                          "max": 1024},
                      "output_len": {"kind": "fixed", "mean": 8, "min": 8, "max": 8},
                      "arrival": {"process": "constant", "rate_rps": 8}},
         "slo": {"p99_ttft_ms": 400, "p99_tpot_ms": 50}},
        {"job_id": "extract-8b", "model": "qwen3-8b", "job_class": "batch", "submitted_at": 300,
         "workload": {"kind": "extraction", "input_len": {**LN, "mean": 1500, "std": 500, "min": 128, "max": 4096},
                      "output_len": {**LN, "mean": 150, "std": 60, "min": 16, "max": 512}},
         "slo": {"deadline_s": 1800, "num_requests": 20000}},
    ],
}

ALL = ["fcfs", "edf", "best-fixed", "prism", "milp", "bandit", "evo", "koi", "koi-nodag", "koi-frozen",
       "koi-physics", "koi-scripted", "llm-only", "koi-llm", "oracle"]


@pytest.fixture(scope="module")
def scenario():
    return parse_scenario(SCENARIO)


def llm_only_model():
    """First reply malformed (no JSON), the repair an empty plan: every job keeps/defers, S5 admits."""
    from koi.agent.llm import CallableChatModel

    def respond(messages, meta):
        if not any(m.role == "assistant" for m in messages):
            return "I would put everything on the H100s, they are fast."
        return '```json\n{"tick_rationale": "wait and see", "actions": []}\n```'

    return CallableChatModel(respond, name="scripted-llm-only")


def options_for(name: str) -> dict[str, Any]:
    if name == "llm-only":
        return {"llm_model": llm_only_model()}
    if name == "koi-llm":
        from koi.agent import scripted
        from koi.agent.llm import CallableChatModel

        return {"llm_model": CallableChatModel(scripted.baseline_policy, name="scripted-baseline")}
    return {}


@dataclass
class Run:
    name: str
    seed: int
    results: list[Any]
    proposer: Any
    engine: Any
    cluster_id: str

    def plans(self) -> list[dict[str, Any]]:
        with session_scope(self.engine) as s:
            out = []
            for r in self.results:
                p = get_plan(s, self.cluster_id, r.tick)
                out.append(json.loads(p.model_dump_json(exclude={"tick_rationale"})))
            return out


#: Policies whose tests look at tick 2 (the first tick with a full window of a rank placed at tick 0)
THREE_TICKS = {"bandit", "evo", "best-fixed"}
#: the learning policies run a tick more: PerfDB takes a rank's window once it has served two full ones
FOUR_TICKS = {"koi", "koi-frozen", "koi-physics"}


def run_policy(tmp_path_factory, scenario, name: str, *, seed: int = 0, n_ticks: int | None = None,
               options: dict[str, Any] | None = None) -> Run:
    n_ticks = n_ticks or (4 if name in FOUR_TICKS else 3 if name in THREE_TICKS else 2)
    spec = get_policy(name)
    path = tmp_path_factory.mktemp(f"{name}-s{seed}") / "koi.db"
    engine = make_engine(f"sqlite:///{path}")
    init_db(engine)
    cid = f"t-{name}-s{seed}"
    world = World(scenario, seed=seed, cluster_id=cid)
    proposer = spec.make_proposer(BenchContext(scenario=scenario, seed=seed, cluster_id=cid, world=world,
                                               options=options_for(name) if options is None else options))

    def skip(session, cluster_id, tick):
        return {}

    rt = Runtime(engine=engine, world=InProcessWorldProvider(worlds={cid: world}), proposers={name: proposer},
                 default_proposer=name, s2=None if spec.run_s2 else skip, s3=None if spec.run_s3 else skip,
                 interval_s=300.0, seed=seed)
    results = run_ticks(rt, cid, n_ticks, jobs=[j.job for j in scenario.jobs], seed=seed, proposer=name)
    return Run(name, seed, results, proposer, engine, cid)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, scenario):
    cache: dict[tuple[str, int], Run] = {}

    def get(name: str, seed: int = 0) -> Run:
        if (name, seed) not in cache:
            cache[(name, seed)] = run_policy(tmp_path_factory, scenario, name, seed=seed)
        return cache[(name, seed)]

    yield get
    for r in cache.values():
        r.engine.dispose()


# ---- the registry --------------------------------------------------------------------------------------------
def test_every_policy_is_registered_with_its_label_family_and_flags():
    # other test modules register throw-away policies named test-*; the builtin set is exactly ALL
    specs = {p.name: p for p in all_policies(llm_configured=True) if not p.name.startswith("test-")}
    assert sorted(specs) == sorted(ALL)
    assert specs["fcfs"].label == "FCFS + first-fit" and specs["milp"].label == "Rolling MILP (no learning)"
    assert specs["oracle"].family is Family.ORACLE and specs["koi-nodag"].family is Family.ABLATION
    assert {p.name for p in all_policies() if not p.name.startswith("test-")} == set(ALL) - {"llm-only", "koi-llm"}  # needs_llm hidden by default
    learning = {n for n, p in specs.items() if p.run_s3}
    assert learning == {"koi", "koi-nodag", "koi-physics", "koi-scripted", "koi-llm"}
    assert {n for n, p in specs.items() if p.run_s2} == learning | {"koi-frozen"}
    assert {n for n, p in specs.items() if p.stochastic} >= {"bandit", "evo", "koi-scripted"}
    assert not specs["koi-scripted"].needs_llm and specs["llm-only"].needs_llm and specs["koi-llm"].needs_llm
    assert all(p.description for p in specs.values())


# ---- every policy through the pipeline ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_every_policy_commits_a_valid_plan_through_the_pipeline(runs, name):
    run = runs(name)
    assert [r.outcome for r in run.results] == [TickOutcome.COMMITTED] * len(run.results), [r.reason for r in run.results]
    assert all(r.validation.valid for r in run.results)
    with session_scope(run.engine) as s:
        for r in run.results:
            row = get_plan_row(s, run.cluster_id, r.tick)
            assert row is not None and row.committed
            plan = get_plan(s, run.cluster_id, r.tick)
            snap = load_stage_model(s, run.cluster_id, r.tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
            assert {a.job_id for a in plan.actions} == {j.job.job_id for j in snap.jobs}  # one action per live job
    # the batch job arrives at 300 s: planned from tick 1 on
    assert [r.plan.n_actions for r in run.results[:2]] == [2, 3]


def test_llm_only_repairs_a_malformed_reply_once_and_records_its_tokens(runs):
    from koi.store import load_stage_output

    run = runs("llm-only")
    with session_scope(run.engine) as s:
        row = load_stage_output(s, run.cluster_id, 0, "S4_llm/a0")
    assert row is not None and row.payload["status"] == "parsed" and row.payload["usage"]["calls"] == 2
    # the empty plan deferred everything; S5's C6 admitted the jobs the plan left waiting
    assert run.results[0].plan.by_type == {"defer": 2} and run.results[0].deploy.launched >= 2


def test_llm_only_keeps_the_jobs_a_twice_failed_reply_wrote_cleanly(tmp_path_factory, scenario):
    """Both turns write two actions for ``moderation``: the repair fails too, and the tick keeps the model's
    plan (its rationale, not the fallback's) with ``chat-8b``'s action, ``moderation`` left to its default;
    the stage output and the run's LLM use say the plan was salvaged."""
    from koi.agent.llm import CallableChatModel
    from koi.bench.llm_use import run_llm_use
    from koi.store import load_stage_output

    reply = json.dumps({"tick_rationale": "hold chat, moderation twice", "actions": [
        {"job_id": "chat-8b", "type": "defer", "ladder": []},
        {"job_id": "moderation", "type": "defer", "ladder": []},
        {"job_id": "moderation", "type": "keep", "ladder": []}]})
    model = CallableChatModel(lambda messages, meta: f"```json\n{reply}\n```", name="scripted-twice")
    run = run_policy(tmp_path_factory, scenario, "llm-only", n_ticks=1, options={"llm_model": model})
    try:
        with session_scope(run.engine) as s:
            out = load_stage_output(s, run.cluster_id, 0, "S4_llm/a0").payload
            proposed = get_plan(s, run.cluster_id, 0)
            use = run_llm_use(s, run.cluster_id, 1)
        assert (out["status"], out["salvaged"], out["usage"]["calls"]) == ("parsed", True, 2)
        assert any("a second action for job 'moderation'" in p for p in out["problems"])
        assert proposed.tick_rationale.startswith("hold chat, moderation twice")  # the model's, then S5's repair
        assert (use.model_plans, use.salvaged_plans, use.fallback_plans) == (1, 1, 0)
        assert run.results[0].outcome is TickOutcome.COMMITTED
    finally:
        run.engine.dispose()


def test_a_runs_llm_use_counts_whose_plans_the_ticks_proposed_and_sums_every_attempts_tokens(runs):
    from koi.bench.llm_use import run_llm_use, tick_llm_use

    run = runs("llm-only")
    with session_scope(run.engine) as s:
        use = run_llm_use(s, run.cluster_id, len(run.results))
    # each tick: a malformed reply, then a parsed repair → the model's plan, two calls
    assert use is not None and use.model == "scripted-llm-only" and use.ticks == 2
    assert (use.model_plans, use.fallback_plans, use.usage.calls) == (2, 0, 4)
    rlm = runs("koi-llm")
    with session_scope(rlm.engine) as s:
        use = run_llm_use(s, rlm.cluster_id, len(rlm.results))
        rows = list_stage_outputs(s, rlm.cluster_id, 0)
        report = next(r for r in rows if r.stage == "S4_rlm/a0").payload
    assert use is not None and use.ticks == len(rlm.results) and use.model == "scripted-baseline"
    assert use.model_plans + use.fallback_plans == use.ticks and use.usage.calls >= use.ticks
    assert use.caps == {"k_max": 64, "max_tokens": 2048, "timeout_s": 240.0}  # RlmConfig's defaults
    assert tick_llm_use(rows).model_plans == int(report["chosen"] >= 0)
    # a policy without a model has no use; a later attempt's verdict replaces an earlier one's
    fcfs = runs("fcfs")
    with session_scope(fcfs.engine) as s:
        assert run_llm_use(s, fcfs.cluster_id, len(fcfs.results)) is None

    @dataclass
    class Row:
        stage: str
        payload: Any

    usage = {"calls": 1, "prompt_tokens": 100, "completion_tokens": 10}
    two = tick_llm_use([Row("S4_llm/a0", {"status": "parsed", "usage": usage, "model": "m", "caps": {"max_tokens": 9}}),
                        Row("S4_llm/a1", {"status": "malformed", "usage": usage, "model": "m",
                                          "caps": {"max_tokens": 64, "note": "x"}}),
                        Row("S4_plan", {"usage": usage})])
    assert (two.model_plans, two.fallback_plans, two.usage.calls, two.usage.prompt_tokens) == (0, 1, 2, 200)
    assert two.caps == {"max_tokens": 64.0}  # the last attempt's, numbers only
    assert two.merge(two.model_copy(update={"caps": {"max_tokens": 128.0}})).caps == {}  # runs that disagree
    bad = tick_llm_use([Row("S4_rlm/a0", {"chosen": 0, "usage": {"calls": "many"}}), Row("S4_rlm/a0/t0", {"chosen": -1})])
    assert (bad.model_plans, bad.usage.calls) == (1, 0)  # an unreadable usage still says whose plan it was


# ---- best fixed --------------------------------------------------------------------------------------------------
def test_best_fixed_never_swaps_and_keeps_its_offline_choice(runs, tmp_path_factory, scenario):
    from koi.bench.policies.best_fixed import BestFixed, class_key

    run = runs("best-fixed")
    prop = run.proposer
    assert len(prop.fixed) == 3 and all(v is not None for v in prop.fixed.values())
    first = dict(prop.fixed)
    assert all("swap" not in r.plan.by_type for r in run.results)  # what it proposed
    for p in run.plans():  # what was committed
        assert not [a for a in p["actions"] if a["type"] == ActionType.SWAP.value]
    # what it places is its class's fixed configuration; running jobs keep
    with session_scope(run.engine) as s:
        for tick in (0, 1, 2):
            ctx = _ctx_at(run, tick, s)
            plan = prop(ctx)
            for a in plan.actions:
                js = ctx.snapshot.job(a.job_id)
                if js.status.value == "active":
                    assert a.type is ActionType.KEEP
                elif a.type is ActionType.PLACE:
                    fx = prop.fixed[class_key(js.job)]
                    assert [(r.env.gpu_type, r.config) for r in a.ladder.ranks] == [(fx.gpu_type, fx.config)]
    assert prop.fixed == first
    # the choice is a pure function of the job and the fleet: a fresh proposer (another seed) picks the same
    fresh = BestFixed(BenchContext(scenario=scenario, seed=7, cluster_id=run.cluster_id))
    with session_scope(run.engine) as s:
        fresh(_ctx_at(run, 2, s))
    assert fresh.fixed == first


# ---- the bandit ---------------------------------------------------------------------------------------------------
def _ctx_at(run: Run, tick: int, session) -> ProposeContext:
    snap = load_stage_model(session, run.cluster_id, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
    return ProposeContext(session=session, cluster_id=run.cluster_id, tick=tick, snapshot=snap)


def test_the_bandit_learns_from_its_own_telemetry_and_its_choices_depend_on_the_seed(runs, scenario):
    run = runs("bandit")
    prop = run.proposer
    assert prop.n_updates > 0 and prop.observed_ticks == {0, 1, 2}
    moved = [k for k, ab in prop.posterior.items() if k in prop.priors and tuple(ab) != prop.priors[k]]
    assert moved, "some (context, arm) posterior moved away from its warm-start prior"
    # every observation adds one unit of pseudo-count (α + β) to its (context, arm)
    added = sum(ab[0] + ab[1] - sum(prop.priors.get(k, (1.0, 1.0))) for k, ab in prop.posterior.items())
    assert added == pytest.approx(prop.n_updates)
    # the same stored tick planned by bandits with other seeds: other samples, and other plans
    from koi.bench.policies.bandit import ThompsonBandit

    plans, samples = set(), []
    with session_scope(run.engine) as s:
        for seed in range(6):
            b = ThompsonBandit(BenchContext(scenario=scenario, seed=seed, cluster_id=run.cluster_id))
            ctx = _ctx_at(run, 2, s)
            plan = b(ctx)
            plans.add(json.dumps([a.model_dump(mode="json", exclude={"rationale"}) for a in plan.actions],
                                 sort_keys=True))
            samples.append(b.last_samples)
            again = ThompsonBandit(BenchContext(scenario=scenario, seed=seed, cluster_id=run.cluster_id))(ctx)
            assert again.actions == plan.actions  # same seed, same tick: same plan
    assert len({json.dumps({j: sorted(v.items()) for j, v in smp.items()}, default=str) for smp in samples}) == 6
    assert len(plans) > 1


# ---- evolutionary search --------------------------------------------------------------------------------------------
def test_evo_fitness_never_decreases_and_beats_its_seed(runs):
    run = runs("evo")
    trace = run.proposer.trace
    assert sorted(trace) == [0, 1, 2]
    for tr in trace.values():
        assert tr.generations > 0
        assert all(b >= a - 1e-12 for a, b in zip(tr.best_per_generation, tr.best_per_generation[1:], strict=False))
        assert tr.best_fitness >= tr.seed_fitness - 1e-12
        assert tr.best_fitness == pytest.approx(tr.best_per_generation[-1])


def test_evo_records_each_ticks_search_and_names_the_budget_when_it_cuts_it(runs, tmp_path_factory, scenario):
    from koi.pipeline.stages import clock_bound_at
    from koi.store.repos.stages import Stage, load_stage_output

    SEARCH_STAGE = str(Stage.S4_SEARCH)

    run = runs("evo")
    with session_scope(run.engine) as s:
        for t in range(3):
            rec = load_stage_output(s, run.cluster_id, t, SEARCH_STAGE).payload
            assert rec["generations"] == rec["of"] == 60 and rec["clock_bound"] == ""
            assert clock_bound_at(s, run.cluster_id, t) == []
    assert [r.plan.clock_bound for r in run.results] == ["", "", ""]  # the tick's result (the Temporal UI's)
    cut = run_policy(tmp_path_factory, scenario, "evo", options={"time_budget_s": 0.0})
    assert all(r.plan.clock_bound == "EvoX's 0 s time budget after 0 of 60 generations" for r in cut.results)
    with session_scope(cut.engine) as s:
        got = [clock_bound_at(s, cut.cluster_id, t) for t in range(3)]
    cut.engine.dispose()
    assert [len(g) for g in got] == [1, 1, 1]
    assert got[1][0] == {"tick": 1, "stage": SEARCH_STAGE, "cut": "EvoX's 0 s time budget after 0 of 60 generations"}


def test_evo_fitness_is_the_selectors_objective_with_violations_penalised(runs):
    from koi.bench.policies._common import baseline_context, job_candidates
    from koi.bench.policies.evo import Fitness
    from koi.planning.selector import build_problem, evaluate, violations

    run = runs("evo")
    with session_scope(run.engine) as s:
        ctx = _ctx_at(run, 1, s)
        pctx = baseline_context(ctx)
        book, _, cands = job_candidates(ctx.snapshot, pctx)
        problem = build_problem(ctx.snapshot, cands, book, pctx.knobs, pctx.exploration)
    fit = Fitness(problem)
    rng = np.random.default_rng(0)
    for _ in range(50):
        g = rng.integers(0, fit.n_opts)
        f = float(fit(g[None, :])[0])
        obj = evaluate(problem, list(g))[0]
        if violations(problem, list(g)):
            assert f < obj - fit.big + 1e-9
            repaired = fit.repair(g, rng)
            assert not violations(problem, list(repaired))
        else:
            assert f == pytest.approx(obj)


# ---- the oracle ------------------------------------------------------------------------------------------------------
def _env(cloud, region, zone, market, gpu):
    return Environment(cloud=cloud, region=region, zone=zone, market=Market(market), gpu_type=gpu)


def test_the_oracle_predictor_differs_from_the_surrogate_exactly_where_a_hidden_effect_applies(scenario):
    from koi.bench.policies.oracle import HiddenTruth, OraclePredictor, OracleSurrogate
    from koi.planning.surrogate_adapter import SurrogatePredictor
    from koi.surrogate import Surrogate

    job = next(j.job for j in scenario.jobs if j.job.job_id == "chat-8b")
    chains = {
        "h100": Chain(env=_env("aws", "us-east-1", "us-east-1a", "on_demand", "H100"),
                      config=ChainConfig(instance_type="p5.48xlarge", tp=1)),
        "l40s-spot": Chain(env=_env("aws", "us-east-1", "us-east-1b", "spot", "L40S"),
                           config=ChainConfig(instance_type="g6e.12xlarge", tp=1)),
        "l4-spot": Chain(env=_env("gcp", "us-central1", "us-central1-c", "spot", "L4"),
                         config=ChainConfig(instance_type="g2-standard-48", tp=1)),
        "a100-tp2": Chain(env=_env("gcp", "us-central1", "us-central1-b", "on_demand", "A100-80GB"),
                          config=ChainConfig(instance_type="a2-ultragpu-4g", tp=2)),
        "l40s-od": Chain(env=_env("aws", "us-east-1", "us-east-1c", "on_demand", "L40S"),  # no effect matches
                         config=ChainConfig(instance_type="g6e.12xlarge", tp=1)),
    }
    truth = HiddenTruth(scenario.hidden)
    plain = SurrogatePredictor(Surrogate())
    names = list(chains)
    base_ttft, base_tpot = plain.latency(job, list(chains.values()), np.full(len(chains), 2.0))
    base_cap = [e.cap_rps for e in plain.estimate(job, list(chains.values()))]

    def differs(now: float) -> dict[str, bool]:
        oracle = OraclePredictor(OracleSurrogate(truth, now))
        assert oracle.env_sensitive
        ttft, tpot = oracle.latency(job, list(chains.values()), np.full(len(chains), 2.0))
        cap = [e.cap_rps for e in oracle.estimate(job, list(chains.values()))]
        out = {}
        for i, n in enumerate(names):
            same = (np.isclose(ttft[i], base_ttft[i], rtol=1e-12) and np.isclose(tpot[i], base_tpot[i], rtol=1e-12)
                    and np.isclose(cap[i], base_cap[i], rtol=1e-12))
            out[n] = not same
            if out[n]:
                assert tpot[i] > base_tpot[i]  # every effect here slows serving down
        return out

    # before the engine change (450 s): efficiency (L4), noisy neighbours (AWS spot), interconnect (A100)
    assert differs(0.0) == {"h100": False, "l40s-spot": True, "l4-spot": True, "a100-tp2": True, "l40s-od": False}
    # after it the AWS H100s are slower too
    assert differs(600.0) == {"h100": True, "l40s-spot": True, "l4-spot": True, "a100-tp2": True, "l40s-od": False}
    f0 = truth.factors(job, chains["l4-spot"], 0.0)
    assert f0 == (pytest.approx(1.15), 1.0)
    assert truth.factors(job, chains["h100"], 600.0)[0] == pytest.approx(1 / 0.8)
    other = Job.model_validate({**job.model_dump(), "job_id": "other"})
    assert truth.factors(other, chains["a100-tp2"], 0.0)[1] == pytest.approx(1.6)  # matches every job


def test_the_oracle_plans_without_the_settle_window_and_the_milp_with_it(runs):
    """The window holds a new rank until its windows are read, against a model's error; the oracle's model is the
    truth, so its context has no window, while the MILP's (the same selector on the surrogate) has the default."""
    from koi.bench.policies._common import baseline_context
    from koi.planning.context import EnumerationParams

    run = runs("oracle")
    with session_scope(run.engine) as s:
        pctx = _ctx_at(run, 1, s)  # the oracle runs two ticks
        mine = run.proposer.context(pctx)
        assert mine.enum.settle_ticks == 0 and mine.predictor.env_sensitive
        assert baseline_context(pctx).enum.settle_ticks == EnumerationParams().settle_ticks > 0
        assert mine.enum.model_copy(update={"settle_ticks": EnumerationParams().settle_ticks}) == \
            baseline_context(pctx).enum  # nothing else differs


# ---- learning on and off ---------------------------------------------------------------------------------------------
def _state(run: Run, tick: int) -> tuple[Any, Any, int]:
    from koi.calibration import load_slow
    from koi.causal.store import load_beliefs

    with session_scope(run.engine) as s:
        slow = load_slow(s, run.cluster_id, tick)
        beliefs = load_beliefs(s, run.cluster_id, tick)
        n_perf = len(query_perf(s, cluster_id=run.cluster_id))
    return slow, beliefs, n_perf


def test_koi_frozen_keeps_beliefs_and_slow_state_at_their_seeds_while_koi_learns(runs):
    koi, frozen = runs("koi"), runs("koi-frozen")
    k_slow, k_beliefs, k_perf = _state(koi, 2)
    seed_slow, seed_beliefs, _ = _state(koi, -1)
    f_slow, f_beliefs, f_perf = _state(frozen, 2)
    # Koi: S3 wrote its slow state every tick and moved beliefs; it wrote PerfDB and learned from it
    assert k_slow.tick == 2 and k_slow.model_dump(exclude={"tick"}) != seed_slow.model_dump(exclude={"tick"})
    assert k_beliefs.edges != seed_beliefs.edges
    assert k_perf > 0
    from koi.planning.tick import load_planning_context

    with session_scope(koi.engine) as s:  # the surrogate S4/S5 load has learned from those records
        assert load_planning_context(s, koi.cluster_id, 2).predictor.env_sensitive
    # frozen: the initial slow state and the seed beliefs at every tick, no PerfDB; evidence still written (S2)
    for t in (0, 1, 2):
        s_t, b_t, _ = _state(frozen, t)
        assert s_t.tick == -1 and s_t.model_dump(exclude={"cluster_id"}) == seed_slow.model_dump(exclude={"cluster_id"})
        assert b_t.edges == seed_beliefs.edges and b_t.mechanisms == seed_beliefs.mechanisms
    assert frozen.results[1].evidence.n_rows > 0
    # S1 records PerfDB for every run (an observation), but the frozen planner never learns from it
    assert f_perf > 0
    from koi.domain import ClusterSnapshot
    from koi.pipeline.runtime import ProposeContext
    from koi.store import Stage, load_stage_model

    with session_scope(frozen.engine) as s:
        snap = load_stage_model(s, frozen.cluster_id, 2, Stage.S0_SNAPSHOT, ClusterSnapshot)
        pctx = ProposeContext(session=s, cluster_id=frozen.cluster_id, tick=2, snapshot=snap)
        assert not frozen.proposer.context(pctx).predictor.env_sensitive
        assert load_planning_context(s, frozen.cluster_id, 2).predictor.env_sensitive  # what S5 reads


def test_koi_physics_learns_everything_but_plans_on_the_operator_physics(runs):
    from koi.domain import ClusterSnapshot
    from koi.pipeline.runtime import ProposeContext
    from koi.planning.tick import load_planning_context
    from koi.store import Stage, load_stage_model

    run = runs("koi-physics")
    slow, beliefs, n_perf = _state(run, 2)
    seed_slow, seed_beliefs, _ = _state(run, -1)
    # the loop runs: S3 moved the slow state and the beliefs, S1 wrote PerfDB
    assert slow.tick == 2 and slow.model_dump(exclude={"tick"}) != seed_slow.model_dump(exclude={"tick"})
    assert beliefs.edges != seed_beliefs.edges and n_perf > 0
    assert any(a["mechanism_id"] for p in run.plans() for a in p["actions"])  # exploration and scoping on
    with session_scope(run.engine) as s:
        # tick 3: the first whose running ladders have settled windows (observed risk is not empty)
        snap = load_stage_model(s, run.cluster_id, 3, Stage.S0_SNAPSHOT, ClusterSnapshot)
        pctx = ProposeContext(session=s, cluster_id=run.cluster_id, tick=3, snapshot=snap)
        mine, full = run.proposer.context(pctx), load_planning_context(s, run.cluster_id, 3)
        # S4 plans on the physics although the records are there (what Koi and S5 fit on) ...
        assert full.predictor.env_sensitive and not mine.predictor.env_sensitive
        # ... with the learned slow state (not the cold-start knobs) and the running ladders' observed risk
        assert mine.knobs == full.knobs and mine.knobs.eps == pytest.approx(_state(run, 3)[0].epsilon)
        assert full.observed_risk and mine.observed_risk == full.observed_risk


def test_koi_nodag_plans_without_exploration_or_mechanism_ids(runs):
    run = runs("koi-nodag")
    for p in run.plans():
        assert all(a["mechanism_id"] is None for a in p["actions"])
        assert all(r.get("mechanism_id") is None for a in p["actions"] for r in (a["ladder"] or []))
    koi = runs("koi")
    assert any(a["mechanism_id"] for p in koi.plans() for a in p["actions"])  # Koi states its hypotheses


# ---- determinism ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bandit", "evo"])
def test_same_seed_same_plans(runs, tmp_path_factory, scenario, name):
    first = runs(name)
    again = run_policy(tmp_path_factory, scenario, name, seed=0)
    assert again.plans() == first.plans()
    again.engine.dispose()


def test_a_tick_whose_milp_a_time_limit_cut_says_so_in_its_result(runs, tmp_path_factory, scenario):
    assert [r.plan.clock_bound for r in runs("milp").results] == ["", ""]
    cut = run_policy(tmp_path_factory, scenario, "milp", options={"time_limit": 1e-9})
    cut.engine.dispose()
    assert all(r.outcome == "committed" for r in cut.results)  # the greedy fallback still plans the tick
    assert all(r.plan.clock_bound.startswith("HiGHS stopped at its 1e-09 s time limit") for r in cut.results)


def test_a_run_records_the_ticks_a_wall_clock_limit_cut(tmp_path):
    from koi.bench.cache import RunCache
    from koi.bench.runner import run_one
    from tests.test_bench_runner import HOURS, write_tiny

    tiny = write_tiny(tmp_path)
    # EvoX with no time budget runs no generation: each tick's plan is its seed plan, and the run says so
    r = run_one(tiny, "evo", 0, hours=HOURS, cache_dir=tmp_path, options={"time_budget_s": 0.0})
    assert [c["tick"] for c in r.meta.clock_bound] == [0, 1]
    assert {c["stage"] for c in r.meta.clock_bound} == {"S4_search"}
    assert all("after 0 of 60 generations" in c["cut"] for c in r.meta.clock_bound)
    assert RunCache(tmp_path).load(r.key).meta.clock_bound == r.meta.clock_bound  # kept in the cache
