"""``koi bench diff`` (issue 8): does a cache reproduce a published report, field by field?

Hand-made runs (the report tests' fakes) go into a cache; the report written from them is the base.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from test_bench_report import POLICIES, fake
from test_bench_runner import HOURS, write_tiny
from typer.testing import CliRunner

from koi.bench.cache import RunCache
from koi.bench.diff import cached_counterpart, compare, restrict
from koi.bench.report import rebuild
from koi.bench.runner import load
from koi.cli import app
from koi.sim.records import RECORD_DTYPE

CHOSEN = [p for p in POLICIES if p[0] in ("koi", "bandit", "koi-frozen", "oracle")]


def _make_cache(root, shift: dict[tuple[str, int], float] | None = None):  # noqa: ANN001, ANN202
    path = write_tiny(root)
    sc, _ = load(path)
    cache = RunCache(root / "cache")
    for name, label, fam, comp in CHOSEN:
        for seed in (0, 1):
            cache.save(fake(sc, name, label, fam, comp + (shift or {}).get((name, seed), 0.0), seed),
                       np.zeros(0, RECORD_DTYPE))
    return path, root / "cache"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff")
    path, cache = _make_cache(root)
    rep = rebuild(str(path), cache_dir=cache, hours=HOURS, figures=False)
    base = root / "report.json"
    base.write_text(json.dumps(rep.json()), encoding="utf-8")
    return path, cache, base, rep.json()


def _diff(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, ["bench", "diff", *args], env={"COLUMNS": "200"})


def test_a_report_equals_itself_and_a_changed_figure_is_named(published):
    _path, _cache_dir, _base, doc = published
    same = compare(doc, copy.deepcopy(doc))
    assert same.equal and same.compared > 100
    other = copy.deepcopy(doc)
    other["policies"]["koi"]["mean"]["composite"] *= 1 + 1e-6
    res = compare(doc, other)
    assert not res.equal
    assert [d.path for d in res.differences] == ["policies.koi.mean.composite"]
    assert res.differences[0].delta == pytest.approx(doc["policies"]["koi"]["mean"]["composite"] * 1e-6)
    assert compare(doc, other, rel_tol=1e-5).equal


def test_what_depends_on_the_machine_is_not_compared(published):
    doc = published[3]
    other = copy.deepcopy(doc)
    other["policies"]["koi"]["wall_s_mean"] += 100.0
    other["policies"]["koi"]["kernels"] = ["numpy X86_V4, OpenBLAS SkylakeX"]
    other["policies"]["koi"]["label"] = "Koi (renamed)"
    other["files"] = {"markdown": "/elsewhere/report.md"}
    assert compare(doc, other).equal


def test_missing_rows_fields_and_unrecorded_counts(published):
    doc = published[3]
    other = copy.deepcopy(doc)
    del other["policies"]["bandit"]
    other["paired"] = [p for p in other["paired"] if p["policy"] != "bandit"]
    del other["policies"]["oracle"]["std"]["goodput_tok_s"]
    other["policies"]["koi"]["mean"]["a_newer_metric"] = 1.0
    res = compare(doc, other)
    assert res.missing_policies == ["bandit"]
    assert [(d.path, d.what) for d in res.differences] == [("policies.oracle.std.goodput_tok_s", "missing")]
    assert res.only_in_other == 1
    # a count the base did not record compares nothing; a figure that was infinite (None) equals only None
    base = copy.deepcopy(doc)
    base["policies"]["koi"]["clock_bound_ticks"] = None
    base["policies"]["koi"]["mean"]["cost_per_slo_token"] = None
    res = compare(base, doc)
    assert [d.path for d in res.differences] == ["policies.koi.mean.cost_per_slo_token"]


def test_the_paired_rows_catch_what_the_means_hide(published):
    """Two seeds swapping their values leave every mean and std as it was; Koi's paired rows see it."""
    doc = published[3]
    other = copy.deepcopy(doc)
    row = next(p for p in other["paired"] if p["policy"] == "bandit")
    row["deltas"]["composite"]["wins"] -= 1
    row["deltas"]["composite"]["losses"] += 1
    res = compare(doc, other)
    assert {d.path for d in res.differences} == {"paired.bandit.deltas.composite.wins",
                                                 "paired.bandit.deltas.composite.losses"}


def test_restricting_to_some_policies_keeps_their_paired_rows_and_drops_the_claims(published):
    doc = published[3]
    cut = restrict(doc, {"koi", "bandit"})
    assert set(cut["policies"]) == {"koi", "bandit"} and "claims" not in cut
    assert [p["policy"] for p in cut["paired"]] == ["bandit"]
    assert "paired" not in restrict(doc, {"bandit"})
    with pytest.raises(ValueError, match="no row of nonesuch"):
        restrict(doc, {"koi", "nonesuch"})
    # the other side's lack of a chosen row is a missing row, not an error
    fewer = copy.deepcopy(doc)
    del fewer["policies"]["bandit"]
    res = compare(restrict(doc, {"koi", "bandit"}), restrict(fewer, {"koi", "bandit"}, strict=False))
    assert res.missing_policies == ["bandit"] and not res.equal
    with pytest.raises(ValueError, match="not a benchmark report"):
        compare({"scenario": "x"}, doc)


def test_the_cache_reproduces_its_own_report(published):
    path, cache, base, doc = published
    cc = cached_counterpart(doc, scenario=str(path), cache_dir=str(cache))
    assert not cc.missing_runs and compare(doc, cc.doc).equal
    res = _diff(str(base), "--scenario", str(path), "--cache-dir", str(cache))
    assert res.exit_code == 0, res.output
    assert "equal" in res.output
    res = _diff(str(base), "--against", str(base))
    assert res.exit_code == 0, res.output


def test_a_run_that_came_out_differently_fails_the_diff_and_is_named(published, tmp_path):
    path, _cache_dir, base, _doc = published
    _p, cache2 = _make_cache(tmp_path, shift={("koi", 1): 0.5})
    res = _diff(str(base), "--scenario", str(path), "--cache-dir", str(cache2))
    assert res.exit_code == 1, res.output
    assert "policies.koi.mean.composite" in res.output and "paired.bandit.deltas.composite.mean" in res.output
    doc = json.loads(_diff(str(base), "--scenario", str(path), "--cache-dir", str(cache2), "--json").stdout)
    assert doc["equal"] is False
    paths = {d["path"] for d in doc["differences"]}
    assert "policies.koi.mean.composite" in paths and not any(".bandit.mean" in p for p in paths)
    # the other policies' rows alone still reproduce
    res = _diff(str(base), "--scenario", str(path), "--cache-dir", str(cache2), "--policies", "bandit,oracle")
    assert res.exit_code == 0, res.output


def test_runs_the_cache_lacks_and_bad_files_fail_clearly(published, tmp_path):
    path, cache, base, doc = published
    more = copy.deepcopy(doc)
    more["policies"]["koi"]["seeds"] = [0, 1, 2]
    f = tmp_path / "more.json"
    f.write_text(json.dumps(more), encoding="utf-8")
    res = _diff(str(f), "--scenario", str(path), "--cache-dir", str(cache))
    assert res.exit_code == 2 and "lacks runs" in res.output and "koi seeds 2" in res.output
    assert f"koi bench run --scenario {path} --policies koi --seeds 1 --first-seed 2 --cache-dir {cache}" in " ".join(res.output.split())
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    res = _diff(str(broken), "--cache-dir", str(cache))
    assert res.exit_code == 2 and "cannot read" in res.output
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"rows": []}), encoding="utf-8")
    res = _diff(str(wrong), "--against", str(base))
    assert res.exit_code == 2 and "not a benchmark report" in res.output
    res = _diff(str(tmp_path / "absent.json"), "--cache-dir", str(cache))
    assert res.exit_code == 2 and "cannot read" in res.output
