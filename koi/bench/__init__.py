"""The benchmark suite: scenarios, policies, the common evaluator, reports and figures."""
