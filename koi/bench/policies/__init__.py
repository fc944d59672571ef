"""The benchmark's policies (issue 8): every planner the evaluation compares, registered by name.

Importing this package registers every policy with :mod:`koi.bench.policy` (``all_policies()``,
``get_policy(name)``). Each module's docstring states what its policy does and where it had
to choose:

========================  ====================================  ============================================
name                      label                                 module
========================  ====================================  ============================================
``fcfs``, ``edf``         FCFS / EDF + first-fit                :mod:`koi.bench.policies.baselines`
``best-fixed``            Best fixed configuration              :mod:`koi.bench.policies.best_fixed`
``prism``                 PRISM (per-job greedy)                :mod:`koi.bench.policies.baselines`
``milp``                  Rolling MILP (no learning)            :mod:`koi.bench.policies.milp`
``bandit``                Contextual Thompson sampling          :mod:`koi.bench.policies.bandit`
``evo``                   Rolling EvoX (evolutionary search)    :mod:`koi.bench.policies.evo`
``koi``                   Koi                                   :mod:`koi.bench.policies.koi_variants`
``koi-nodag``             Koi without DAG/mechanisms            :mod:`koi.bench.policies.koi_variants`
``koi-frozen``            Koi without online learning           :mod:`koi.bench.policies.koi_variants`
``koi-physics``           Koi without residual learning         :mod:`koi.bench.policies.koi_variants`
``koi-scripted``          Koi with a scripted LLM               :mod:`koi.bench.policies.koi_variants`
``llm-only``, ``koi-llm`` LLM only (no tools) / Koi with LLM    :mod:`koi.bench.policies.llm` (need an LLM)
``oracle``                Oracle (true performance)             :mod:`koi.bench.policies.oracle`
========================  ====================================  ============================================

Common ground (:mod:`koi.bench.policies._common`): a policy is a proposer object built once per
run, holding that run's state; every plan goes through the same S5 (C0–C7, one repair, keep-all)
and S6; policies without the causal loop plan with the fresh surrogate, β = 0 and no exploration
model; the pipeline's S1 writes PerfDB for every run (:mod:`koi.evidence.perfdb`) and only the
learning policies plan with a surrogate fitted on it (:mod:`koi.bench.policies.perfdb`).
"""

from koi.bench.policies import (  # noqa: F401  (each module registers its policies on import)
    bandit,
    baselines,
    best_fixed,
    evo,
    koi_variants,
    llm,
    milp,
    oracle,
)
