"""The sandbox audit: every escape and abuse attempt of the corpus is contained; the CLI reports it."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from koi.agent.audit import run_audit
from koi.agent.audit_corpus import CORPUS, cases
from koi.cli import app


def test_the_corpus_covers_what_the_issue_lists():
    assert len(CORPUS) >= 30
    ids = {c.case_id for c in CORPUS}
    assert len(ids) == len(CORPUS)
    for must in ("import-os", "import-subprocess", "import-socket", "open-etc-passwd", "subclasses-walk",
                 "func-globals", "code-object", "generator-frame", "traceback-frame", "eval", "exec", "compile",
                 "infinite-loop", "memory-bomb", "huge-print", "fork-bomb", "write-outside", "forged-final-print",
                 "tool-huge-payload", "tool-wrong-type", "tool-path-arg", "tool-negative", "unknown-tool"):
        assert must in ids, must
    assert cases("raw") and cases("tool") and cases("repl")


@pytest.mark.skipif(os.geteuid() != 0, reason="the OS layers (netns, chroot, uid drop) need root on this machine")
def test_every_case_is_contained_and_the_tick_still_plans():
    report = run_audit()
    bad = [(r.case_id, r.outcome, r.checks) for r in report.results if not r.contained]
    assert not bad, bad
    assert report.contained == report.total == len(CORPUS) + 1
    assert all(v.startswith("enforced") for v in report.layers.values()), report.layers
    e2e = report.results[-1]
    assert e2e.case_id == "tick-still-plans" and e2e.checks["plan_valid"]


def test_cli_sandbox_audit_prints_one_json_document():
    res = CliRunner().invoke(app, ["agent", "sandbox-audit", "--json", "--no-end-to-end",
                                   "--case", "import-os", "--case", "forged-final-print", "--case", "unknown-tool"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["contained"] == doc["total"] == 3
    assert {r["case_id"] for r in doc["results"]} == {"import-os", "forged-final-print", "unknown-tool"}


def test_cli_rejects_unknown_cases_and_lists_tools():
    res = CliRunner().invoke(app, ["agent", "sandbox-audit", "--case", "no-such-case"])
    assert res.exit_code == 2
    res = CliRunner().invoke(app, ["agent", "tools", "--json"])
    assert res.exit_code == 0 and any(t["signature"].startswith("compute_sigma(") for t in json.loads(res.stdout))
