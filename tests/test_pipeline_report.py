"""A run's summary and its Markdown report (what ``koi demo`` prints and writes), from a real store and world."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.sim import load_scenario
from koi.pipeline import InProcessWorldProvider, Runtime, run_tick, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.pipeline.report import summarize_run, summary_markdown
from koi.store import init_db, make_engine, session_scope

CLUSTER = "report-sim"


@pytest.fixture
def run(tmp_path):
    """Tick 0 planned by Koi, tick 1 by a proposer that falls over (a fallback with a '|' in its reason)."""
    from koi.sim.world import World

    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    world = World(load_scenario("demo"), cluster_id=CLUSTER)
    rt = Runtime(engine=eng, world=InProcessWorldProvider(worlds={CLUSTER: world}), interval_s=300.0)
    first = run_ticks(rt, CLUSTER, 1, jobs=[j.job for j in load_scenario("demo").jobs])[0]

    def broken(ctx):
        raise RuntimeError("planner fell over | twice")

    second = run_tick(rt, CLUSTER, 1, proposer=broken)
    assert (first.outcome, second.outcome) == (TickOutcome.COMMITTED, TickOutcome.FALLBACK)
    with session_scope(eng) as s:
        summary = summarize_run(s, CLUSTER, world)
    yield first, summary
    eng.dispose()


def test_per_tick_rows_say_how_each_tick_ended_and_what_it_did(run):
    first, summary = run
    t0, t1 = summary["per_tick"]
    assert (t0["tick"], t0["status"], t1["tick"], t1["status"]) == (0, "committed", 1, "fallback")
    assert t0["actions"].get("place", 0) == first.deploy.launched > 0
    assert sum(t0["actions"].values()) == sum(summary["actions"].values())  # the fallback committed nothing
    assert t1["actions"] == {} and "planner fell over" in t1["reason"]
    assert t0["total_s"] > 0
    assert summary["ticks"] == {**summary["ticks"], "total": 2, "committed": 1, "fallback": 1}


def test_each_jobs_dollars_are_its_instances_and_add_up_to_the_fleets_bill(run):
    """Per job: the instances its ranks held, by market, over its own output tokens; with the idle reserved
    commitment they make the fleet's cost."""
    _, summary = run
    jobs = summary["per_job"]
    assert sum(j["cost_usd"] for j in jobs) + summary["idle_reserved_usd"] == pytest.approx(summary["cost_usd"], abs=1e-3)
    paying = [j for j in jobs if j["cost_usd"] > 0]
    assert paying, "tick 0 placed jobs: their instances cost something"
    for j in jobs:
        assert sum(j["cost_by_market"].values()) == pytest.approx(j["cost_usd"], abs=1e-3)
        assert set(j["cost_by_market"]) <= {"reserved", "on_demand", "spot"}
        if j["output_tokens"]:
            assert j["usd_per_mtok"] == pytest.approx(j["cost_usd"] / j["output_tokens"] * 1e6, rel=1e-3)
        else:
            assert j["usd_per_mtok"] is None


def test_the_markdown_report_holds_the_fleet_each_job_and_each_tick(run):
    _, summary = run
    doc = {**summary, "scenario": "demo", "ui": "http://localhost:8233/x", "next": [{"command": "koi ticks --cluster report-sim", "what": "each tick"}]}
    md = summary_markdown(doc)
    assert md.startswith("# Koi run report-sim — scenario demo\n")
    assert "| jobs admitted | " in md and "| Temporal UI | http://localhost:8233/x |" in md
    jobs = md.split("## Jobs")[1].split("## Ticks")[0]
    for j in summary["per_job"]:
        assert f"| {j['job_id']} | {j['class']} | " in jobs
    ticks = md.split("## Ticks")[1].split("## Where")[0]
    rows = [r for r in ticks.splitlines() if r.startswith("| 0 ") or r.startswith("| 1 ")]
    assert rows[0].startswith("| 0 | committed | ") and "place " in rows[0]
    assert rows[1].startswith("| 1 | fallback | ") and "fell over \\| twice" in rows[1]  # the pipe is escaped
    assert rows[1].count(" | ") == 4  # five cells: the escaped pipe does not split the row
    assert md.rstrip().endswith("- `koi ticks --cluster report-sim`: each tick")


def test_the_demo_writes_the_report_and_lists_where_to_look(run, tmp_path):
    from workers.demo import next_commands, write_report

    _, summary = run
    summary = {**summary, "started": ["temporal", "worker (in process)"]}
    cmds = next_commands(summary, keep_running=False)
    lines = [c["command"] for c in cmds]
    assert lines[0] == "koi up" and f"koi plan replay 1 --cluster {CLUSTER}" in lines
    assert any(c.startswith("koi why job chat-8b ") for c in lines) and all(c["what"] for c in cmds)
    assert next_commands(summary, keep_running=True)[0]["command"] != "koi up"  # the server is still up
    summary["next"] = cmds
    paths = write_report(summary, tmp_path / "runs" / CLUSTER)
    back = json.loads((tmp_path / "runs" / CLUSTER / "summary.json").read_text())
    assert back["report"] == paths and back["per_tick"] == summary["per_tick"]
    assert Path(paths["markdown"]).read_text(encoding="utf-8") == summary_markdown(back)
