#!/usr/bin/env bash
# Start the local PostgreSQL when it is down, rather than skipping the tests that need it.
# Install Debian's docker-compose when missing: tests/test_temporal_compose.py validates
# docker-compose.yml with `docker-compose config` (no Docker engine needed).
# Fetch Debian's Prometheus and nginx into .venv/opt (scripts/ensure-debian-tools.sh) for the tests that run them.
set -euo pipefail
if ! command -v docker-compose >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing docker-compose (apt)" >&2
    (apt-get install -y -qq docker-compose >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq docker-compose >/dev/null 2>&1; }) \
      || echo "could not install docker-compose; tests/test_temporal_compose.py will fail" >&2
  else
    echo "docker-compose is missing (apt-get install docker-compose); tests/test_temporal_compose.py will fail" >&2
  fi
fi
"$(dirname "$0")/ensure-debian-tools.sh"
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
