"""benchmarks/residual_prequential.py: the learner's prequential errors split by whether the chain was new."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from koi.domain import ChainConfig, Rank
from tests.test_surrogate_residual import biased_records, env

_SPEC = importlib.util.spec_from_file_location(
    "residual_prequential", Path(__file__).resolve().parents[1] / "benchmarks" / "residual_prequential.py")
rp = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(rp)


def test_a_chains_first_record_is_counted_new_and_is_predicted_worse_than_its_later_ones():
    records = []
    for i, tp in enumerate((1, 2)):
        rank = Rank(env=env(), config=ChainConfig(tp=tp, instance_type="p5.48xlarge"), n_replicas=1)
        records += [r.model_copy(update={"tick": 50 * i + r.tick}) for r in biased_records(40, bias=1.5, rank=rank)]
    out = rp.prequential_errors(records, ("p99_tpot_ms",))
    tpot = out["quantities"]["p99_tpot_ms"]
    assert tpot["new"]["n"] == 2 and tpot["seen"]["n"] == tpot["all"]["n"] - 2
    # a 1.5× slowdown: the first chain's first record is predicted by nothing, later ones by its own fit
    assert tpot["new"]["mean_abs_log"] > 2 * tpot["seen"]["mean_abs_log"]
    assert np.isfinite(tpot["all"]["median_abs_log"])
