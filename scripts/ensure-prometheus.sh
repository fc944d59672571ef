#!/usr/bin/env bash
# Put Debian's Prometheus server in .venv/opt/prometheus (no root, no service started): tests/test_infra_prometheus.py
# runs a real Prometheus on loopback against loopback vLLM pages. Skipped when `prometheus` is on PATH already.
set -euo pipefail
dest=".venv/opt/prometheus"
if command -v prometheus >/dev/null || [ -x "$dest/usr/bin/prometheus" ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "prometheus is missing and apt-get/dpkg-deb are not here; tests/test_infra_prometheus.py will fail" >&2
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching Debian's prometheus into $dest" >&2
(cd "$tmp" && { apt-get download -qq prometheus >/dev/null 2>&1 \
  || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && apt-get download -qq prometheus >/dev/null 2>&1; }; }) \
  || { echo "could not download prometheus; tests/test_infra_prometheus.py will fail" >&2; exit 0; }
mkdir -p "$dest"
dpkg-deb -x "$tmp"/prometheus_*.deb "$dest"
"$dest/usr/bin/prometheus" --version 2>&1 | head -n 1 >&2
