"""A run's summary from the store and the simulated world: what ``koi demo`` prints.

Figures (choices where the brief is vague):
- **jobs admitted**: jobs the planner placed at least once (``admitted_tick`` set) of those submitted;
- **goodput**: output tokens per simulated second of requests that met their SLO — online:
  TTFT and TPOT within target; batch: finished before the job's deadline;
- **$/token**: the fleet's cost so far (allocated instances and idle reserved commitment)
  over every output token produced, also given per million tokens; per job, the instances its ranks
  held (each at its pool's price from allocation to release, by market) over the job's own output
  tokens — the idle reserved commitment is the fleet's, so the jobs' dollars add up to the fleet's
  less that (``idle_reserved_usd``);
- **TTFT / TPOT attainment**: over online requests that ended (served or not; a request
  never served misses both), the fraction within the job's TTFT (TPOT) target;
- **swaps**: swap actions in committed plans (a job moved to a new ladder);
- **ticks**: outcomes and the mean wall time of a tick's stages (S0–S6, from the store); ``per_tick``
  lists each tick's outcome, its reason (a fallback's or failure's), its wall time and the actions
  of its plan when that plan was committed.

:func:`summary_markdown` renders a summary as the Markdown report ``koi demo`` writes beside its
JSON (``KOI_DATA_DIR/runs/<cluster>/``), so a run can be read after its servers are gone.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from sqlalchemy.orm import Session
from sqlmodel import select

from koi.domain import JobClass


def summarize_run(session: Session, cluster_id: str, world: Any | None) -> dict[str, Any]:
    from koi.store import get_jobs, list_actions, list_ticks
    from koi.store.tables import PlanRow

    ticks = list_ticks(session, cluster_id)
    outcomes = Counter(t.status for t in ticks)
    totals = [float(t.timings.get("total", 0.0)) for t in ticks if t.timings]
    committed = set(session.exec(
        select(PlanRow.tick).where(PlanRow.cluster_id == cluster_id, PlanRow.committed.is_(True))
    ))
    acts = [a for a in list_actions(session, cluster_id) if a.tick in committed]
    by_type = Counter(a.action_type for a in acts)
    by_tick: dict[int, Counter] = {}
    for a in acts:
        by_tick.setdefault(a.tick, Counter())[a.action_type] += 1
    jobs = get_jobs(session, cluster_id)
    out: dict[str, Any] = {
        "cluster_id": cluster_id,
        "ticks": {
            "total": len(ticks),
            "committed": outcomes.get("committed", 0),
            "fallback": outcomes.get("fallback", 0),
            "failed": outcomes.get("failed", 0),
            "mean_tick_s": round(float(np.mean(totals)), 3) if totals else None,
            "max_tick_s": round(float(np.max(totals)), 3) if totals else None,
        },
        "jobs": {
            "submitted": len(jobs),
            "admitted": sum(1 for j in jobs if j.admitted_tick is not None),
            "by_status": dict(Counter(j.status.value for j in jobs)),
        },
        "actions": dict(by_type),
        "swaps": by_type.get("swap", 0),
        "per_tick": [
            {"tick": t.tick, "status": t.status, "reason": t.reason or "",
             "total_s": round(float(t.timings["total"]), 3) if t.timings and "total" in t.timings else None,
             "actions": dict(sorted(by_tick.get(t.tick, Counter()).items()))}
            for t in ticks
        ],
    }
    if world is not None:
        out.update(world_figures(world))
    return out


def world_figures(world: Any) -> dict[str, Any]:
    """Goodput, $/token and SLO attainment from a ``koi.sim`` World's per-request records."""
    from koi.sim.records import Status

    inner = getattr(world, "inner", world)
    rec = inner.records()
    now = float(inner.now())
    cost = inner.cost()
    ended = rec[rec["status"] != Status.UNFINISHED]
    served_mask = ended["status"] == Status.SERVED
    good_tokens = 0.0
    ttft_ok = tpot_ok = online_n = 0
    per_job = []
    for jr in inner.jobs:
        job = jr.job
        r = ended[ended["job"] == jr.idx]
        s = r[r["status"] == Status.SERVED]
        ttft = (s["first_token"] - s["arrival"]) * 1e3
        tpot = np.where(s["tokens_out"] > 1, (s["finish"] - s["first_token"]) / np.maximum(s["tokens_out"] - 1, 1) * 1e3, 0.0)
        markets = cost.get("per_job_market", {}).get(job.job_id, {})
        usd, out_tokens = float(sum(markets.values())), int(s["tokens_out"].sum())
        row: dict[str, Any] = {"job_id": job.job_id, "class": job.job_class.value, "ended": int(len(r)),
                               "served": int(len(s)), "output_tokens": out_tokens, "cost_usd": round(usd, 4),
                               "cost_by_market": {m: round(v, 4) for m, v in sorted(markets.items())},
                               "usd_per_mtok": round(usd / out_tokens * 1e6, 4) if out_tokens else None}
        if job.job_class is JobClass.ONLINE:
            t_ok = ttft <= (job.slo.p99_ttft_ms or np.inf)
            p_ok = tpot <= (job.slo.p99_tpot_ms or np.inf)
            good_tokens += float(s["tokens_out"][t_ok & p_ok].sum())
            online_n += len(r)
            ttft_ok += int(t_ok.sum())
            tpot_ok += int(p_ok.sum())
            row["ttft_attainment"] = round(float(t_ok.sum()) / len(r), 4) if len(r) else None
            row["tpot_attainment"] = round(float(p_ok.sum()) / len(r), 4) if len(r) else None
            row["p99_ttft_ms"] = round(float(np.percentile(ttft, 99)), 1) if len(s) else None
            row["p99_tpot_ms"] = round(float(np.percentile(tpot, 99)), 1) if len(s) else None
        else:
            deadline = job.deadline_at if job.deadline_at is not None else np.inf
            on_time = s["finish"] <= deadline
            good_tokens += float(s["tokens_out"][on_time].sum())
            row["requests"] = job.slo.num_requests
            row["finished_at_s"] = jr.finished_at
            if jr.finished_at is not None:
                row["deadline_met"] = bool(jr.finished_at <= deadline)
            else:  # unfinished: missed once the deadline has passed, not yet due before
                row["deadline_met"] = False if now > deadline else None
        per_job.append(row)
    tokens = float(ended["tokens_out"][served_mask].sum())
    total_cost = float(cost["total"])
    return {
        "simulated_s": now,
        "requests": {"ended": int(len(ended)), "served": int(served_mask.sum()),
                     "unfinished": int(np.sum(rec["status"] == Status.UNFINISHED))},
        "output_tokens": int(tokens),
        "goodput_tokens_per_s": round(good_tokens / now, 2) if now > 0 else 0.0,
        "cost_usd": round(total_cost, 4),
        "idle_reserved_usd": round(float(cost.get("idle_reserved", 0.0)), 4),
        "usd_per_token": (total_cost / tokens) if tokens else None,
        "usd_per_mtok": round(total_cost / tokens * 1e6, 4) if tokens else None,
        "ttft_attainment": round(ttft_ok / online_n, 4) if online_n else None,
        "tpot_attainment": round(tpot_ok / online_n, 4) if online_n else None,
        "per_job": per_job,
    }


def _cell(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) and abs(x) >= 10_000:
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1 else f"{x:,.2f}"
    return str(x).replace("|", "\\|")


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * float(x):.1f}%"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return out


def summary_markdown(summary: dict[str, Any]) -> str:
    """The run's report in Markdown: the fleet's figures, each job, each tick, and where to look next.

    Pure: everything comes from ``summary`` (what :func:`summarize_run` returned, plus the demo's
    ``scenario``, ``ui`` and ``next`` — ``{command, what}`` pairs — when present).
    """
    tk, jb = summary["ticks"], summary["jobs"]
    title = f"# Koi run {summary['cluster_id']}"
    if summary.get("scenario"):
        title += f" — scenario {summary['scenario']}"
    lines = [title, ""]
    rows: list[list[Any]] = [
        ["ticks", f"{tk['total']} ({tk['committed']} committed, {tk['fallback']} fallback, {tk['failed']} failed)"],
        ["time per tick (S0–S6)", f"mean {_cell(tk['mean_tick_s'])} s, max {_cell(tk['max_tick_s'])} s"],
        ["jobs admitted", f"{jb['admitted']} of {jb['submitted']}"],
    ]
    if "goodput_tokens_per_s" in summary:
        rq = summary["requests"]
        rows += [
            ["SLO goodput", f"{summary['goodput_tokens_per_s']:,.2f} output tokens/s"],
            ["cost", f"${summary['cost_usd']:,.2f} (${_cell(summary['usd_per_mtok'])} per million output tokens)"],
            ["TTFT attainment", _pct(summary["ttft_attainment"])],
            ["TPOT attainment", _pct(summary["tpot_attainment"])],
            ["requests", f"{rq['served']:,} served of {rq['ended']:,} ended ({rq['unfinished']:,} in flight)"],
        ]
    rows += [["swaps", summary["swaps"]],
             ["actions", ", ".join(f"{k} {v}" for k, v in sorted(summary["actions"].items())) or "–"]]
    if summary.get("ui"):
        rows.append(["Temporal UI", summary["ui"]])
    lines += _table(["", ""], rows)
    if summary.get("per_job"):
        cols = ["job_id", "class", "served", "ended", "output_tokens", "cost_usd", "usd_per_mtok", "p99_ttft_ms",
                "p99_tpot_ms", "ttft_attainment", "tpot_attainment", "deadline_met"]
        body = [[r.get(c) if "attainment" not in c else _pct(r.get(c)) for c in cols] for r in summary["per_job"]]
        lines += ["", "## Jobs", "", *_table(cols, body)]
    if summary.get("per_tick"):
        body = [[t["tick"], t["status"], t["total_s"], ", ".join(f"{k} {v}" for k, v in t["actions"].items()) or "–",
                 t["reason"] or "–"] for t in summary["per_tick"]]
        lines += ["", "## Ticks", "", *_table(["tick", "outcome", "seconds", "actions (committed)", "reason"], body)]
    if summary.get("next"):
        lines += ["", "## Where to look next", ""] + [f"- `{c['command']}`: {c['what']}" for c in summary["next"]]
    return "\n".join(lines) + "\n"
