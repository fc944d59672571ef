"""``koi sim run|bench|fidelity|check``: one JSON document with --json, clear errors on bad input."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from koi.cli import app

runner = CliRunner()


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_sim_run_demo_json():
    doc = _json(runner.invoke(app, ["sim", "run", "demo", "--hours", "0.05", "--json"]))
    assert doc["scenario"] == "demo"
    assert {j["job_id"] for j in doc["jobs"]} >= {"chat-8b", "summarize-70b"}
    f = doc["fleet"]
    assert f["requests"] > 0 and f["cost_usd"] > 0 and f["simulated_s"] == 180.0


def test_sim_run_table_output():
    r = runner.invoke(app, ["sim", "run", "demo", "--hours", "0.02"])
    assert r.exit_code == 0, r.output
    assert "jobs" in r.stdout and "chat-8b" in r.stdout


def test_sim_bench_json_small():
    doc = _json(runner.invoke(app, ["sim", "bench", "--hours", "0.02", "--gpus", "40", "--json"]))
    assert doc["fleet_gpus"] >= 30 and doc["wall_s"] > 0 and doc["gpu_hours_per_wall_s"] > 0
    assert doc["requests"] > 0


def test_sim_fidelity_json_small():
    doc = _json(runner.invoke(app, ["sim", "fidelity", "--limit", "3", "--json"]))
    assert doc["all"]["rows"] == 3
    assert doc["all"]["tpot_median_abs_pct"] >= 0


def test_sim_check_reports_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nduration_s: 10\npools: []\n")
    r = runner.invoke(app, ["sim", "check", str(bad)])
    assert r.exit_code == 2
    assert "pools" in r.output
    from koi.sim.scenario import demo_path

    doc = _json(runner.invoke(app, ["sim", "check", str(demo_path()), "--json"]))
    assert doc["valid"] and doc["gpus"] == 40


def test_a_scenario_that_does_not_load_is_a_clear_error_for_every_command_that_takes_one(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nduration_s: -5\n")
    for args in (["sim", "run"], ["learn"]):
        for path in (str(tmp_path / "missing.yaml"), str(bad)):
            r = runner.invoke(app, [*args, path, "--json"])
            assert r.exit_code == 2, (args, r.output)
            assert "error:" in r.output and "Traceback" not in r.output
            assert r.stdout.strip() == "" or not r.stdout.lstrip().startswith("{")

