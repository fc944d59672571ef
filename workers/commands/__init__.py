"""``koi`` commands that drive Temporal: ops (submit, status, ticks, reset-tick), dev/up/down, worker, demo.

They live outside ``koi/`` because they start workers and talk to Temporal, which the
domain never imports; the ``koi`` CLI loads them through the ``koi.commands`` entry
points declared in pyproject.toml.
"""
