"""The store: SQLModel tables and typed repositories; SQLite by default, PostgreSQL by URL.

Usage::

    from koi.store import make_engine, init_db, session_scope, save_plan, get_plan

    engine = make_engine()          # KOI_DATABASE_URL, or the SQLite file under KOI_DATA_DIR
    init_db(engine)                 # Alembic upgrade to head (never create_all)
    with session_scope(engine) as s:
        save_plan(s, "koi-dev", plan, committed=False)

Every repository function takes the session first and leaves commit to
:func:`session_scope`. Writes a retried step repeats are upserts on the table's
UNIQUE key, so they leave one row.
"""

from koi.store.db import init_db, make_engine, normalise_url, session_scope, store_url
from koi.store.migrations import current_revision, downgrade, head_revision, upgrade
from koi.store.repos.beliefs import (
    MechanismBelief,
    edge_belief_history,
    load_edge_beliefs,
    load_mechanism_beliefs,
    save_edge_beliefs,
    save_mechanism_beliefs,
)
from koi.store.repos.deploy import (
    DeployStatus,
    deploy_key,
    get_deploy,
    list_deploys,
    record_deploy,
    update_deploy,
)
from koi.store.repos.deployments import get_deployments, save_deployment, save_deployments
from koi.store.repos.fence import advance_fence, fence_allows, get_fence
from koi.store.repos.jobs import get_job, get_jobs, save_job, save_job_state, set_job_status
from koi.store.repos.observations import (
    get_evidence,
    get_predictions,
    get_telemetry,
    save_evidence,
    save_prediction,
    save_telemetry,
)
from koi.store.repos.perf import PerfRecord, query_perf, save_perf_record, save_perf_records
from koi.store.repos.plans import (
    get_plan,
    get_plan_row,
    latest_committed_plan,
    list_actions,
    mark_plan_committed,
    save_plan,
)
from koi.store.repos.slow_state import (
    load_slow_state,
    load_slow_state_as,
    load_slow_state_row,
    save_slow_state,
)
from koi.store.repos.stages import (
    Stage,
    digest,
    list_stage_outputs,
    load_stage_model,
    load_stage_output,
    save_stage_output,
)
from koi.store.repos.ticks import TickStatus, get_tick, list_ticks, save_tick
from koi.store.upsert import insert_if_absent, upsert

__all__ = [
    "DeployStatus",
    "MechanismBelief",
    "PerfRecord",
    "Stage",
    "TickStatus",
    "advance_fence",
    "current_revision",
    "deploy_key",
    "digest",
    "downgrade",
    "edge_belief_history",
    "fence_allows",
    "get_deploy",
    "get_deployments",
    "get_evidence",
    "get_fence",
    "get_job",
    "get_jobs",
    "get_plan",
    "get_plan_row",
    "get_predictions",
    "get_telemetry",
    "get_tick",
    "head_revision",
    "init_db",
    "insert_if_absent",
    "latest_committed_plan",
    "list_actions",
    "list_deploys",
    "list_stage_outputs",
    "list_ticks",
    "load_edge_beliefs",
    "load_mechanism_beliefs",
    "load_slow_state",
    "load_slow_state_as",
    "load_slow_state_row",
    "load_stage_model",
    "load_stage_output",
    "make_engine",
    "mark_plan_committed",
    "normalise_url",
    "query_perf",
    "record_deploy",
    "save_deployment",
    "save_deployments",
    "save_edge_beliefs",
    "save_evidence",
    "save_job",
    "save_job_state",
    "save_mechanism_beliefs",
    "save_perf_record",
    "save_perf_records",
    "save_plan",
    "save_prediction",
    "save_slow_state",
    "save_stage_output",
    "save_telemetry",
    "save_tick",
    "session_scope",
    "set_job_status",
    "store_url",
    "update_deploy",
    "upgrade",
    "upsert",
]
