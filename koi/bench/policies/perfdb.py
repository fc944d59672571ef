"""Which benchmark policies learn from PerfDB.

The pipeline's S1 writes PerfDB for every run (:mod:`koi.evidence.perfdb`): observing a
deployment is the same whatever planned it. What differs is who *reads* it: the learning
policies plan with a surrogate fitted on it; the others plan with a fresh one.
"""

from __future__ import annotations

#: The policies whose S4 plans with a surrogate learned from PerfDB.
PERFDB_POLICIES = frozenset({"koi", "koi-nodag", "koi-scripted", "koi-llm"})
