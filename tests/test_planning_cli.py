"""`koi plan ...`: one JSON document with --json."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from koi.cli import app


def _json(args: list[str]) -> dict:
    # structlog's PrintLogger holds the stderr it was configured with; CliRunner swaps (and closes) its own,
    # so bind the logger to the test's stderr before each invocation
    from koi.logging import configure

    configure()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_example_opportunity_cost_json() -> None:
    doc = _json(["plan", "example", "opportunity-cost", "--json"])
    for order in ("batch_first", "online_first"):
        assert doc[order]["joint"]["chat"].endswith("H100")
        assert doc[order]["joint"]["batch-eval"].endswith("A100-80GB")
    assert doc["batch_first"]["prism_greedy"]["chat"] == "defer"


def test_example_reclaim_json() -> None:
    doc = _json(["plan", "example", "reclaim", "--json"])
    assert doc["tick_18"]["qwen235"] == "defer" and doc["tick_18"]["phi4-svc"] == "keep"
    assert doc["tick_18"]["service_capacity_tps"] == 1572.0 and doc["tick_18"]["service_requirement_tps"] == 834.0
    assert doc["tick_20"]["qwen235"].startswith("place")


def test_propose_json() -> None:
    doc = _json(["plan", "propose", "--jobs", "6", "--gpus", "80", "--envs", "3", "--predictor", "analytic", "--json"])
    assert doc["stage"] in ("proposed", "repaired", "keep_all")
    assert len(doc["plan"]["actions"]) == 6 and doc["selection"]["solver"] in ("milp", "greedy")


def test_bench_rejects_unknown_names() -> None:
    res = CliRunner().invoke(app, ["plan", "bench", "--only", "nope"])
    assert res.exit_code != 0
