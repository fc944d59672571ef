#!/usr/bin/env bash
# Put Debian's Prometheus and nginx servers in .venv/opt/<package> (downloaded and unpacked: no root needed, no
# service started). tests/test_infra_prometheus.py runs a real Prometheus and tests/test_infra_gateway.py a real
# nginx on loopback. A tool already on PATH is used as it is.
set -euo pipefail
fetch() {  # fetch <package> <binary path inside the package>
  local pkg=$1 bin=$2 dest=".venv/opt/$1"
  if command -v "$(basename "$bin")" >/dev/null || [ -x "$dest/$bin" ]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "$pkg is missing and apt-get/dpkg-deb are not here; the tests that run it will fail" >&2
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  echo "fetching Debian's $pkg into $dest" >&2
  if (cd "$tmp" && { apt-get download -qq "$pkg" >/dev/null 2>&1 \
      || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && apt-get download -qq "$pkg" >/dev/null 2>&1; }; }); then
    mkdir -p "$dest"
    dpkg-deb -x "$tmp/${pkg}"_*.deb "$dest"
  else
    echo "could not download $pkg; the tests that run it will fail" >&2
  fi
  rm -rf "$tmp"
}
fetch prometheus usr/bin/prometheus
fetch nginx usr/sbin/nginx
