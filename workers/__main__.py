"""``python -m workers``: run a Koi worker (both task queues) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio

from koi.logging import configure
from workers.main import run_worker

if __name__ == "__main__":
    configure()
    from koi.procexit import exit_process

    asyncio.run(run_worker())
    exit_process(0)
