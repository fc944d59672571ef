"""``koi plan replay``: a stored tick's S4 re-run read-only (koi.planning.replay).

One Koi run of the bench's tiny scenario (two online jobs, a batch job arriving at the second tick)
with its SQLite store kept; every tick of it is replayed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from koi.bench.runner import run_one
from koi.planning.replay import replay_s4
from koi.store import Stage, load_stage_output, make_engine, query_perf, session_scope
from tests.test_bench_runner import write_tiny

TICKS = 6  # PerfDB's first records come at tick 3 (settled windows), so ticks 3-4 replay without later ones


@pytest.fixture(scope="module")
def koi_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    r = run_one(write_tiny(d), "koi", 2, hours=TICKS * 300 / 3600, cache_dir=d / "cache", keep_store=True)
    assert r.meta.ticks_committed == TICKS
    return r


@pytest.fixture
def engine(koi_run):
    eng = make_engine(f"sqlite:///{koi_run.meta.store}")
    yield eng
    eng.dispose()


def _counts(engine) -> dict[str, int]:
    import sqlalchemy as sa

    with engine.connect() as c:
        return {t: c.execute(sa.text(f"select count(*) from {t}")).scalar_one()
                for t in ("plans", "actions", "stage_outputs", "perfdb", "slow_state")}


def test_every_tick_replays_to_the_stored_proposal_and_nothing_is_written(koi_run, engine):
    before = _counts(engine)
    cid = koi_run.meta.cluster_id
    with session_scope(engine) as s:
        record_ticks = {r.tick for r in query_perf(s, cluster_id=cid)}
    assert len(record_ticks) >= 2  # so a replay of an early tick has later records to leave out
    for tick in range(TICKS):
        with session_scope(engine) as s:
            rep = replay_s4(s, cid, tick)
            stored = load_stage_output(s, cid, tick, Stage.S4_PLAN).payload["plan"]["actions"]
            n_records = len([r for r in query_perf(s, cluster_id=cid) if r.tick <= tick])
        assert rep.reproduced, [j for j in rep.jobs if not j.same]
        assert [(j.job_id, j.replayed) for j in rep.jobs] == [(a["job_id"], a["type"]) for a in stored]
        assert rep.perf_records == n_records
        for j in rep.jobs:
            chosen = [o for o in j.options if o.chosen]
            assert chosen, f"{j.job_id}: the option the plan took is listed"
            assert j.options[0].kind in ("keep", "defer")  # the null option comes first
            if j.replayed in ("place", "swap"):
                assert chosen[-1].kind == j.replayed and chosen[-1].ladder and chosen[-1].gpus > 0
                assert chosen[-1].admissible  # what a plan takes passes C3 or has it waived
    assert _counts(engine) == before


def test_each_option_shows_its_predicted_p99s_beside_the_jobs_targets(koi_run, engine):
    """What C3's risk is read on: the ladder's predicted p99 TTFT and TPOT (its worst rank's at the load
    share the planner assumed), next to the online job's targets; a defer has none, a batch job no targets."""
    from koi.domain import ClusterSnapshot, JobClass
    from koi.store import load_stage_model

    cid = koi_run.meta.cluster_id
    with session_scope(engine) as s:
        rep = replay_s4(s, cid, 3)
        snap = load_stage_model(s, cid, 3, Stage.S0_SNAPSHOT, ClusterSnapshot)
    seen = 0
    for j in rep.jobs:
        job = snap.job(j.job_id).job
        if job.job_class is JobClass.ONLINE:
            assert (j.target_ttft_ms, j.target_tpot_ms) == (job.slo.p99_ttft_ms, job.slo.p99_tpot_ms)
        else:
            assert j.target_ttft_ms is None and j.target_tpot_ms is None
        for o in j.options:
            if not o.ladder:
                assert o.p99_ttft_ms is None and o.p99_tpot_ms is None
                continue
            assert o.p99_ttft_ms is not None and o.p99_tpot_ms is not None
            assert o.p99_ttft_ms > 0 and o.p99_tpot_ms > 0
            if job.job_class is JobClass.ONLINE and o.admissible and not o.repair and o.p_brk < 0.05:
                # a ladder C3 calls nearly safe is predicted under its targets
                assert o.p99_tpot_ms <= j.target_tpot_ms and o.p99_ttft_ms <= j.target_ttft_ms
                seen += 1
    assert seen, "some online option is predicted well under its targets"
    res = _invoke(["plan", "replay", "3", "--job", "chat-8b", "--cluster", cid, "--url",
                   f"sqlite:///{koi_run.meta.store}"])
    slo = snap.job("chat-8b").job.slo
    assert res.exit_code == 0 and f"targets {slo.p99_ttft_ms:g} / {slo.p99_tpot_ms:g} ms" in res.stdout
    assert "p99 TTFT/TPOT ms" in res.stdout


def test_a_later_tick_sees_the_jobs_that_arrived(koi_run, engine):
    with session_scope(engine) as s:
        first = replay_s4(s, koi_run.meta.cluster_id, 0)
        second = replay_s4(s, koi_run.meta.cluster_id, 1, jobs=["extract"], top=2)
    assert "extract" not in {j.job_id for j in first.jobs}  # the batch job arrives at 300 s
    (job,) = second.jobs
    assert job.job_id == "extract" and len([o for o in job.options if o.kind == "place"]) <= 3


def test_unknown_tick_or_job_is_a_clear_error(koi_run, engine):
    with session_scope(engine) as s, pytest.raises(ValueError, match="no S0 snapshot at tick 99"):
        replay_s4(s, koi_run.meta.cluster_id, 99)
    with session_scope(engine) as s, pytest.raises(ValueError, match="no job 'nope'"):
        replay_s4(s, koi_run.meta.cluster_id, 1, jobs=["nope"])


def _invoke(args: list[str]):  # noqa: ANN202 - click Result
    from koi.cli import app
    from koi.logging import configure

    configure()  # bind structlog to this test's stderr: CliRunner swaps (and closes) its own
    return CliRunner().invoke(app, args)


def test_the_cli_prints_the_replay(koi_run):
    url = f"sqlite:///{koi_run.meta.store}"
    cid = koi_run.meta.cluster_id
    res = _invoke(["plan", "replay", "1", "--cluster", cid, "--url", url, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["tick"] == 1 and doc["reproduced"] is True and {j["job_id"] for j in doc["jobs"]} >= {"chat-8b"}
    res = _invoke(["plan", "replay", "1", "--job", "chat-8b", "--cluster", cid, "--url", url])
    assert res.exit_code == 0 and "reproduces the stored S4 plan" in res.stdout and "chat-8b" in res.stdout
    res = _invoke(["plan", "replay", "99", "--cluster", cid, "--url", url])
    assert res.exit_code == 2 and "no S0 snapshot at tick 99" in res.output


def test_bench_run_keeps_the_store_a_replay_reads(tmp_path):
    """The operator's path: ``koi bench run --keep-store`` names each run's store; ``koi plan replay`` opens it."""
    scenario = write_tiny(tmp_path)
    res = _invoke(["bench", "run", "--scenario", str(scenario), "--policies", "koi", "--seeds", "1", "--hours", "0.1",
                   "--jobs", "1", "--keep-store", "--no-report", "--cache-dir", str(tmp_path / "cache"), "--json"])
    assert res.exit_code == 0, res.output
    (run,) = json.loads(res.stdout)["runs"]
    assert run["store"] and run["cluster_id"] == "bench-koi-s0"
    res = _invoke(["plan", "replay", "1", "--cluster", run["cluster_id"], "--url", f"sqlite:///{run['store']}", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["reproduced"] is True
    res = _invoke(["bench", "run", "--scenario", str(scenario), "--policies", "koi", "--seeds", "1", "--hours", "0.1",
                   "--keep-store", "--via", "temporal", "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 2 and "--keep-store" in res.output


def test_a_replay_names_the_wall_clock_limit_that_cut_the_stored_tick(koi_run, tmp_path):
    import shutil

    from koi.store.repos.stages import save_stage_output

    copy = tmp_path / "koi.db"
    shutil.copy(koi_run.meta.store, copy)
    url, cid = f"sqlite:///{copy}", koi_run.meta.cluster_id
    eng = make_engine(url)
    with session_scope(eng) as s:
        before = replay_s4(s, cid, 2)
        assert before.stored_clock_bound == "" and before.clock_bound == ""
        row = load_stage_output(s, cid, 2, Stage.S4_PLAN)
        payload = {**row.payload, "selection": {**row.payload["selection"],
                                                "clock_bound": "HiGHS stopped at its 10 s time limit"}}
        save_stage_output(s, cid, 2, Stage.S4_PLAN, payload, row.input_digest)
    with session_scope(eng) as s:
        assert replay_s4(s, cid, 2).stored_clock_bound == "HiGHS stopped at its 10 s time limit"
    eng.dispose()
    res = _invoke(["plan", "replay", "2", "--cluster", cid, "--url", url])
    assert res.exit_code == 0, res.output
    assert "the stored tick's search was cut by the clock (HiGHS stopped at its 10 s time limit)" in res.stdout


def _script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_swap_causes_replays_exactly_the_stored_swaps(koi_run, engine):
    """benchmarks/swap_causes.py on a real kept store: at every tick it reports the swaps S4 stored and no other
    (the tiny run's ladders hold, so this pins that a keep is never counted; the rules are pinned below)."""
    sc = _script("swap_causes")
    cid = koi_run.meta.cluster_id
    with session_scope(engine) as s:
        for tick in range(TICKS):
            got = sc.classify_tick(s, cid, tick)
            stored = load_stage_output(s, cid, tick, Stage.S4_PLAN).payload["plan"]["actions"]
            assert sorted(r["job"] for r in got) == sorted(a["job_id"] for a in stored if a["type"] == "swap")


def test_swap_causes_rules_on_hand_made_options():
    """Each cause from the running ladder's state: C3 failed → repair; demand unserved → short; kept when
    β = 0 → exploration; else voluntary, with the value margin (σ minus W·priority·unserved) over the keep."""
    from types import SimpleNamespace as NS

    from koi.domain.job import JobStatus
    from koi.planning.options import OptionKind
    from koi.scoring.params import PlanningKnobs

    sc = _script("swap_causes")
    knobs = PlanningKnobs()

    def opt(kind, sigma, gpus, c3_ok=True, unserved=0.0, price=10.0):
        return NS(kind=kind, sigma=sigma, j=sigma, p_brk=0.0, gpus=gpus, c3_ok=c3_ok, unserved=unserved,
                  ranks=(NS(price=price),))

    keeps = {"a": opt(OptionKind.KEEP, -0.5, 8, c3_ok=False), "b": opt(OptionKind.KEEP, -0.2, 8, unserved=0.1),
             "c": opt(OptionKind.KEEP, -0.30, 8), "d": opt(OptionKind.KEEP, -0.30, 8), "e": opt(OptionKind.KEEP, -0.3, 8),
             "f": opt(OptionKind.KEEP, -0.30, 8)}
    choice = {"a": opt(OptionKind.SWAP, -0.3, 4, price=5.0), "b": opt(OptionKind.SWAP, -0.25, 16),
              "c": opt(OptionKind.SWAP, -0.29, 8), "d": opt(OptionKind.SWAP, -0.28, 16, price=12.0),
              "e": keeps["e"], "f": opt(OptionKind.SWAP, -0.35, 8)}
    cands = {j: NS(keep=k, state=NS(status=JobStatus.ACTIVE, job=NS(priority=1.0))) for j, k in keeps.items()}
    prop = NS(selection=NS(choice=choice), candidates=cands)
    no_expl = {**choice, "c": keeps["c"]}
    rows = {r["job"]: r for r in sc.classify(7, prop, knobs, no_expl)}
    assert set(rows) == {"a", "b", "c", "d", "f"}  # e kept
    assert [rows[j]["cause"] for j in "abcdf"] == ["repair", "short", "exploration", "voluntary", "displaced"]
    assert [rows[j]["direction"] for j in "abcd"] == ["in", "out", "same", "out"]
    assert rows["d"]["margin"] == pytest.approx(0.02) and rows["d"]["usd_h"] == pytest.approx(2.0)
    assert rows["d"]["dj"] == pytest.approx(0.02) and rows["d"]["keep_p_brk"] == 0.0
    out = sc.summarize(list(rows.values()))
    assert out["swaps"] == 5 and out["causes"] == {"repair": 1, "short": 1, "exploration": 1, "voluntary": 1,
                                                   "displaced": 1}
    assert out["voluntary_margin"]["below_0.05"] == 1 and out["voluntary_from"]["dj_median"] == pytest.approx(0.02)
    w = knobs.unserved_weight * knobs.priority_weight(1.0)
    assert rows["b"]["margin"] == pytest.approx(-0.25 - (-0.2 - w * 0.1))


def test_doubt_vs_misses_reads_the_kept_ladders_and_the_reports_windows(koi_run, engine):
    """benchmarks/doubt_vs_misses.py on a real kept store: a row per online job the stored plan kept, and the
    window flags are the very pairs the report's p99 SLO windows % counts."""
    from pathlib import Path

    from koi.domain.cluster import ClusterSnapshot
    from koi.domain.common import JobClass
    from koi.store import load_stage_model

    dvm = _script("doubt_vs_misses")
    root = Path(koi_run.meta.store).parents[2]
    (run_json,) = root.glob("*/runs/koi/*.json")
    records = np.load(run_json.with_suffix(".npz"))["records"]
    missed = dvm.missed_windows(koi_run, records)
    assert missed and 100.0 * sum(not m for m in missed.values()) / len(missed) == pytest.approx(
        koi_run.metrics.p99_windows_pct)
    cid = koi_run.meta.cluster_id
    with session_scope(engine) as s:
        for tick in range(TICKS):
            rows = dvm.kept_doubts(s, cid, tick, koi_run.meta.tick_s)
            stored = load_stage_output(s, cid, tick, Stage.S4_PLAN).payload["plan"]["actions"]
            kept = {a["job_id"] for a in stored if a["type"] == "keep"}
            online = {j.job.job_id for j in load_stage_model(s, cid, tick, Stage.S0_SNAPSHOT, ClusterSnapshot).jobs
                      if j.job.job_class is JobClass.ONLINE}
            assert {r["job"] for r in rows} == kept & online and all(r["window"] == tick for r in rows)
    res = _invoke_script(dvm, [koi_run.meta.store, str(run_json), "--cluster", cid])
    assert res["ticks"] == TICKS and res["pairs"] > 0 and abs(res["x_mean"]) < 1.0
    assert len(res["posterior"]["quartiles"]) == 4  # the same ladders under the learned posterior's doubt


def _invoke_script(mod, argv: list[str]) -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        mod.main(argv)
    return json.loads(buf.getvalue())


def test_doubt_vs_misses_summary_on_hand_made_rows():
    """Miss share per quartile of x and the correlation's sign: misses on the most doubted ladders correlate."""
    dvm = _script("doubt_vs_misses")
    rows = [{"x": i * 0.05, "x_registry": i * 0.05 - 0.5, "x_posterior": -i * 0.05, "p_brk": 0.01, "missed": i >= 15}
            for i in range(20)]
    out = dvm.summarize(rows)
    post = dvm.summarize(rows, "x_posterior")  # the other doubt ranks the same ladders the other way round
    assert [q["miss_share"] for q in post["quartiles"]] == [1.0, 0.0, 0.0, 0.0] and post["corr"] < -0.5
    assert out["pairs"] == 20 and out["miss_share"] == pytest.approx(0.25)
    assert [q["miss_share"] for q in out["quartiles"]] == [0.0, 0.0, 0.0, 1.0]
    assert out["corr"] > 0.5 and out["x_registry_mean"] == pytest.approx(out["x_mean"] - 0.5)
    assert out["p_brk_mean"] == pytest.approx(0.01)
    assert dvm.summarize([]) == {"pairs": 0}
