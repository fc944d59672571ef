"""``koi deploys`` on a real store: what S6 applied, tick by tick, including a rolling replacement."""

from __future__ import annotations

import json

import pytest
from fakes.swap_cluster import JOB, swap_runtime
from typer.testing import CliRunner

from koi.pipeline import run_ticks
from koi.pipeline.messages import TickOutcome

CLUSTER = "c-deploys"


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'koi.db'}"
    rt = swap_runtime(url)
    out = run_ticks(rt, CLUSTER, 3, jobs=[JOB])
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 3
    rt.engine.dispose()
    return url


def _invoke(*args: str):
    from koi.cli import app

    return CliRunner().invoke(app, ["deploys", *args])


def test_deploys_shows_a_rolling_replacement(store) -> None:
    res = _invoke("--tick", "1", "--cluster", CLUSTER, "--url", store, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ops = [(o["op"], o["status"], o["replicas"], o["from"], o["handover"], o["release"]) for o in doc["operations"]]
    # the pool is full: the old rank gives back the 4 instances the new one needs, serves on the other 4
    assert ops == [("scale", "scaled", 4, 8, None, "partial"), ("launch", "launched", 4, None, None, None),
                   ("teardown", "drained", None, None, True, None)]  # fmt: skip
    assert {o["tick"] for o in doc["operations"]} == {1} and all(o["job"] == "chat" for o in doc["operations"])
    # every tick, newest last; a job filter that matches nothing is empty, not an error
    res = _invoke("--cluster", CLUSTER, "--url", store, "--json")
    assert [o["tick"] for o in json.loads(res.stdout)["operations"]] == [0, 1, 1, 1]
    res = _invoke("--job", "nope", "--cluster", CLUSTER, "--url", store, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["operations"] == []
    res = _invoke("--tick", "1", "--cluster", CLUSTER, "--url", store)
    assert res.exit_code == 0 and "partial" in res.stdout and "scale" in res.stdout


def test_deploys_fails_clearly_without_a_store(tmp_path) -> None:
    missing = tmp_path / "none.db"
    res = _invoke("--url", f"sqlite:///{missing}")
    assert res.exit_code != 0 and "no store" in res.output and not missing.exists()
    res = _invoke("--tick", "-1", "--url", f"sqlite:///{missing}")
    assert res.exit_code != 0 and "--tick" in res.output
