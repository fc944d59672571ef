"""Per-request records for the evaluator: one row per request, columnar (numpy structured arrays).

Every request the scenario generates ends in exactly one terminal record, served or
not, so the evaluator's denominators are the workload's own ("a planner cannot
improve its score by refusing or dropping work"). Requests still in flight when the
records are read are reported with status ``UNFINISHED`` (not stored).

Fields: ``rid`` (job index << 40 | sequence number), ``job``/``rank``/``replica``
(indices into :attr:`World.job_ids` / :attr:`World.rank_ids`; -1 when never placed),
``arrival``, ``first_token``, ``finish`` (seconds; NaN when it did not happen),
``tokens_in``, ``tokens_out`` (tokens actually produced), ``cached`` (prompt tokens
served by the prefix cache at the last admission), ``preemptions``, ``status``.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Status(IntEnum):
    SERVED = 0  # finished: all output tokens produced
    DROPPED = 1  # no replica took it before the gateway timeout (online), or the job left first
    TIMEOUT = 2  # queued on an engine past the client timeout without a first token (online)
    FAILED = 3  # its replica died or was torn down after it had produced tokens
    UNFINISHED = 4  # still queued or in flight when read (never stored)


RECORD_DTYPE = np.dtype(
    [
        ("rid", np.int64),
        ("job", np.int32),
        ("rank", np.int32),
        ("replica", np.int32),
        ("arrival", np.float64),
        ("first_token", np.float64),
        ("finish", np.float64),
        ("tokens_in", np.int32),
        ("tokens_out", np.int32),
        ("cached", np.int32),
        ("preemptions", np.int16),
        ("status", np.int8),
    ]
)


class RecordStore:
    """Terminal records appended in chunks; concatenated on read."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.count = 0

    def add(self, rec: np.ndarray) -> None:
        if len(rec):
            self.chunks.append(rec)
            self.count += len(rec)
            if len(self.chunks) >= 256:  # fold the small tail, leaving the big chunks alone
                big = [c for c in self.chunks if len(c) >= 65536]
                small = [c for c in self.chunks if len(c) < 65536]
                self.chunks = [*big, np.concatenate(small)]

    def all(self) -> np.ndarray:
        if not self.chunks:
            return np.zeros(0, dtype=RECORD_DTYPE)
        if len(self.chunks) > 1:
            self.chunks = [np.concatenate(self.chunks)]
        return self.chunks[0]

    def __getstate__(self) -> dict:
        return {"chunks": [self.all()] if self.count else [], "count": self.count}

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)


def blank(n: int) -> np.ndarray:
    rec = np.zeros(n, dtype=RECORD_DTYPE)
    rec["rank"] = -1
    rec["replica"] = -1
    rec["first_token"] = np.nan
    rec["finish"] = np.nan
    return rec


def sort_records(rec: np.ndarray) -> np.ndarray:
    """Records in a canonical order (by request id) for comparisons."""
    return rec[np.argsort(rec["rid"], kind="stable")]
