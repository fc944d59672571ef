"""Settings, read from the environment with the prefix ``KOI_`` (and a ``.env`` file).

Every process reads the same settings: the CLI, the workers, the tests. The defaults
are the embedded set-up (a SQLite file under ``KOI_DATA_DIR``, a Temporal dev server
on localhost); production points ``KOI_DATABASE_URL`` at PostgreSQL and
``KOI_TEMPORAL_ADDRESS`` at a Temporal cluster.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KOI_", env_file=".env", extra="ignore")

    # ---- store ------------------------------------------------------------------------
    data_dir: Path = Field(default=Path(".koi"), description="where the SQLite file, caches and reports live")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; postgresql+psycopg://... for PostgreSQL. Default: SQLite in data_dir"
    )

    # ---- Temporal ---------------------------------------------------------------------
    temporal_address: str = "localhost:7233"
    temporal_namespace: str = "default"
    temporal_ui_port: int = 8233
    tick_task_queue: str = "koi-ticks"
    plan_task_queue: str = "koi-planning"
    cluster_id: str = "koi-dev"
    world: Literal["sim", "aws", "gcp", "azure"] = Field(default="sim", description="what `koi worker` runs the "
                                                         "ticks against: the simulated fleet, Amazon EC2, Google "
                                                         "Compute Engine or Azure VMs (then fleet_file)")
    fleet_file: Path | None = Field(default=None, description="a real world's fleet file (infra/cloud.py FleetSpec)")
    tick_interval_s: float = Field(default=300.0, gt=0, description="planning tick (Appendix B: ~300 s)")
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description="`koi worker` serves Koi's metrics "
                                     "for Prometheus on this port (infra/metrics.py); None: not served")
    metrics_addr: str = Field(default="0.0.0.0", description="the address the metrics are served on")  # noqa: S104

    # ---- LLM (the RLM planner) ------------------------------------------------------------
    llm_base_url: str | None = None
    llm_model: str | None = None
    llm_api_key: str = "not-needed"
    llm_system_role: bool = True
    llm_price_per_mtok_in: float = 0.0
    llm_price_per_mtok_out: float = 0.0
    llm_max_tokens: int | None = Field(default=None, ge=64, description="cap on a reply's tokens (RLM turns, "
                                       "specialists, the LLM-only planner); default: each planner's own")
    llm_timeout_s: float = Field(default=120.0, gt=0, description="one chat completion's HTTP timeout (the client "
                                 "retries twice); a CPU-served model answering a whole fleet's prompt needs more")
    llm_response_format: Literal["none", "json_schema", "json_object"] = Field(
        default="none", description="the LLM-only planner's decoding: free text, or constrained to the plan's JSON "
                                    "Schema in the OpenAI (json_schema) or llama-cpp-python (json_object) form")
    rlm_max_turns: int | None = Field(default=None, ge=1, le=512, description="K_MAX, turns per trajectory "
                                      "(Appendix B: 64)")
    rlm_timeout_s: float | None = Field(default=None, gt=0, description="wall clock per trajectory (default 240 s)")

    # ---- logs -----------------------------------------------------------------------------
    log_format: Literal["console", "json"] = "console"
    log_level: str = "INFO"

    # ---- determinism ------------------------------------------------------------------------
    seed: int = 0

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'koi.db').resolve()}"


@cache
def get_settings() -> Settings:
    return Settings()
