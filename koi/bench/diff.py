"""Does a benchmark reproduce? A published or earlier report compared, field by field, with another.

``koi bench diff BASE`` (:mod:`koi.cli.bench`) reads a report's JSON (``report.json`` from ``koi bench
report --json``, or the ``summary.json`` a report writes) and compares it with another such file or with
what the cache holds for the same policies and seeds. Every run is deterministic under its seed, so
the same code on the same scenario must give the same figures on any machine (when no wall-clock limit
cut a plan: ``clock_bound_ticks``), and a change to the code that moves a figure shows here by name.

What is compared (every leaf of the base, by path):

- ``policies.<policy>``: the seeds, run and tick counts, fallback and clock-bound ticks, and the mean and
  std of every metric;
- ``paired.<policy>``: Koi against that policy, paired by seed (mean, standard error, wins/ties/losses
  of every paired metric) — per-seed differences, which equal means alone could hide;
- ``claims.<claim> | <against>``: the paper's claims (value, target, met), keyed by the claim's text and
  the label of the policy it is against (a renamed policy shows as a missing claim);
- the scenario's name, its file's digest and the horizon.

Choices (the issue asks for reproducible results and says no more):

- **Left out**: what depends on the machine or is cosmetic, never on the plans — wall seconds, the
  numeric kernels' names, a language model's latency, the written files' paths and the labels.
- **Numbers** are equal within ``rel_tol`` (default 1e-9: summation order aside, a rerun gives the same
  float) or ``abs_tol``; ``None`` (a metric that was infinite, a count a run did not record) equals
  only ``None`` — except that a base which did not record a count (``clock_bound_ticks`` before it
  existed) compares nothing there. Booleans, strings and lists compare exactly.
- **Fields only the other side has** are not differences (a newer evaluator adds metrics); they are
  counted. A field only the base has is one ("missing"), and a whole policy the other side lacks is one
  difference, not one per field.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from pydantic import Field

from koi.domain.common import KoiModel

#: Keys whose values depend on the machine or are cosmetic (anywhere in the document).
IGNORED_KEYS = frozenset({"wall_s_mean", "kernels", "latency_s", "files", "label"})
#: Counts a base may lack the record of (None: not recorded; nothing to compare).
UNRECORDED_OK = frozenset({"clock_bound_ticks"})


class FieldDiff(KoiModel):
    path: str = Field(description="where, e.g. policies.koi.mean.composite")
    base: Any = None
    other: Any = None
    what: str = Field(description="differs | missing (the other side lacks it)")

    @property
    def delta(self) -> float | None:
        if _is_num(self.base) and _is_num(self.other):
            return float(self.other) - float(self.base)
        return None


class DiffResult(KoiModel):
    scenario: str
    compared: int = Field(description="leaves of the base compared")
    differences: list[FieldDiff] = Field(default_factory=list)
    missing_policies: list[str] = Field(default_factory=list, description="policies of the base the other lacks")
    only_in_other: int = Field(0, description="leaves only the other side has (not differences)")
    rel_tol: float
    abs_tol: float

    @property
    def equal(self) -> bool:
        return not self.differences and not self.missing_policies


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _keyed(items: Any, key: str | tuple[str, ...]) -> dict[str, Any]:
    """A list of records as a mapping by their identity (so order does not matter)."""
    keys = (key,) if isinstance(key, str) else key
    out: dict[str, Any] = {}
    for i, it in enumerate(items if isinstance(items, list) else []):
        if isinstance(it, Mapping) and all(k in it for k in keys):
            out[" | ".join(str(it[k]) for k in keys)] = it
        else:
            out[f"[{i}]"] = it
    return out


def normalise(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The comparable part of a report's JSON: lists of records keyed by what they are about."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("policies"), Mapping):
        raise ValueError("not a benchmark report: no 'policies' mapping (expected `koi bench report --json` "
                         "output, report.json or summary.json)")
    out: dict[str, Any] = {k: doc[k] for k in ("scenario", "scenario_digest", "hours") if k in doc}
    out["policies"] = dict(doc["policies"])
    if "paired" in doc:
        out["paired"] = _keyed(doc["paired"], "policy")
    if "claims" in doc:
        out["claims"] = _keyed(doc["claims"], ("claim", "against"))
    return out


def leaves(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every comparable leaf; lists of scalars are leaves."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            if k in IGNORED_KEYS:
                continue
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, node


def same(a: Any, b: Any, rel_tol: float, abs_tol: float) -> bool:
    if _is_num(a) and _is_num(b):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return math.isclose(fa, fb, rel_tol=rel_tol, abs_tol=abs_tol)
    return a == b


def compare(base: Mapping[str, Any], other: Mapping[str, Any], *, rel_tol: float = 1e-9,
            abs_tol: float = 0.0) -> DiffResult:
    """Every comparable leaf of ``base`` against ``other`` (both a report's JSON)."""
    if rel_tol < 0 or abs_tol < 0:
        raise ValueError("tolerances must be ≥ 0")
    b, o = normalise(base), normalise(other)
    missing = sorted(p for p in b["policies"] if p not in o["policies"])
    gone = {f"policies.{p}" for p in missing} | {f"paired.{p}" for p in missing}
    ob = dict(leaves(o))
    bl = dict(leaves(b))
    diffs: list[FieldDiff] = []
    n = 0
    for path, bv in bl.items():
        if any(path == g or path.startswith(g + ".") for g in gone):
            continue
        if bv is None and path.rsplit(".", 1)[-1] in UNRECORDED_OK:
            continue
        n += 1
        if path not in ob:
            diffs.append(FieldDiff(path=path, base=bv, other=None, what="missing"))
        elif not same(bv, ob[path], rel_tol, abs_tol):
            diffs.append(FieldDiff(path=path, base=bv, other=ob[path], what="differs"))
    extra = sum(1 for p in ob if p not in bl)
    return DiffResult(scenario=str(b.get("scenario", o.get("scenario", "?"))), compared=n, differences=diffs,
                      missing_policies=missing, only_in_other=extra, rel_tol=rel_tol, abs_tol=abs_tol)


def restrict(doc: Mapping[str, Any], policies: Collection[str], *, strict: bool = True) -> dict[str, Any]:
    """A report's JSON cut to some of its policies. Koi's paired rows stay for the chosen policies when Koi is
    one of them (each is Koi against one policy on their common seeds); the claims go (they compare Koi
    with the best of all the policies). ``strict``: a policy the report lacks is an error (for the base;
    the other side's lack shows as a missing row)."""
    d = normalise(doc)
    unknown = sorted(set(policies) - set(d["policies"]))
    if unknown and strict:
        raise ValueError(f"the report has no row of {', '.join(unknown)} (it has {', '.join(sorted(d['policies']))})")
    out: dict[str, Any] = {k: v for k, v in doc.items() if k not in ("policies", "paired", "claims")}
    out["policies"] = {p: r for p, r in d["policies"].items() if p in policies}
    if "koi" in policies and "paired" in doc:
        out["paired"] = [r for r in doc["paired"] if isinstance(r, Mapping) and r.get("policy") in policies]
    return out


def seeds_of(base: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each policy of a report and the seeds its row was made of."""
    pol = normalise(base)["policies"]
    out = {}
    for name, row in pol.items():
        seeds = row.get("seeds") if isinstance(row, Mapping) else None
        if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise ValueError(f"policy {name!r} of the report has no list of seeds")
        out[str(name)] = [int(s) for s in seeds]
    return out


class CachedCounterpart(KoiModel):
    """What the cache holds for a base report's policies and seeds, as a report's JSON."""

    doc: dict[str, Any] = Field(default_factory=dict)
    missing_runs: dict[str, list[int]] = Field(default_factory=dict, description="policy → seeds not cached")


def cached_counterpart(base: Mapping[str, Any], *, scenario: str | None = None, cache_dir: str | None = None,
                       via: str = "in-process") -> CachedCounterpart:
    """The cached runs of every (policy, seed) the base was made of, reported as the base was.

    The scenario is the base's (or ``scenario``, for a YAML path), at the base's horizon; the runs are
    those of the scenario file as it is now (a changed file shows as a changed ``scenario_digest``).
    """
    from koi.bench.report import policy_rows, report_json, select_runs

    want = seeds_of(base)
    name = scenario or base.get("scenario")
    if not isinstance(name, str) or not name:
        raise ValueError("the report names no scenario; pass --scenario")
    hours = base.get("hours")
    sc_name, digest, h, runs = select_runs(name, cache_dir=cache_dir, hours=float(hours) if _is_num(hours) else None,
                                           via=via, policies=set(want), seeds={s for ss in want.values() for s in ss})
    runs = [r for r in runs if r.key.seed in want.get(r.key.policy, ())]
    have = {(r.key.policy, r.key.seed) for r in runs}
    missing = {p: [s for s in ss if (p, s) not in have] for p, ss in want.items()}
    missing = {p: ss for p, ss in missing.items() if ss}
    if missing or not runs:
        return CachedCounterpart(missing_runs=missing or want)
    rows = policy_rows(runs)
    return CachedCounterpart(doc=report_json(sc_name, digest, h, rows, runs=runs))
