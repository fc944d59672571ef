#!/usr/bin/env bash
# Start the local PostgreSQL when it is down, rather than skipping the tests that need it.
set -euo pipefail
if command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432; then
  exit 0
fi
if command -v pg_ctlcluster >/dev/null; then
  ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  echo "starting PostgreSQL $ver" >&2
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 1 30); do
    pg_isready -q -h 127.0.0.1 -p 5432 && exit 0
    sleep 1
  done
fi
echo "PostgreSQL is not reachable on 127.0.0.1:5432; the store tests will fail" >&2
