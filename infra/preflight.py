"""What the fleet file asks of the worker's own host, checked before the first tick (``koi fleet check``, beside the
cloud's :meth:`infra.replicas.RankReads.preflight`): Prometheus answering where S1 (and ``health_via: prometheus``)
will read, the directories Koi writes for Prometheus' file discovery and for the gateway writable, the gateway's
reload command present. Each is an answer (:class:`infra.replicas.Check`), never a raise; nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx

from infra.replicas import Check


def _writable(what: str, directory: str) -> Check:
    """Create the directory if need be, then write and remove a file in it (as Koi's atomic writes do)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=".koi-check-")
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return Check(what, False, f"{directory}: {exc.strerror or exc}")
    return Check(what, True, f"{directory} writable")


def host_checks(spec: Any, timeout_s: float = 5.0) -> list[Check]:
    """The checks the fleet file's settings ask for (none for what it leaves out). ``spec``: a
    :class:`infra.cloud.FleetSpec`."""
    out: list[Check] = []
    if spec.prometheus_url:
        what = f"Prometheus at {spec.prometheus_url}"
        try:
            r = httpx.get(f"{spec.prometheus_url.rstrip('/')}/api/v1/status/buildinfo", timeout=timeout_s)
            version = r.json().get("data", {}).get("version", "?") if r.status_code == 200 else None
            out.append(Check(what, version is not None,
                             f"version {version}" if version is not None else f"HTTP {r.status_code}: {r.text[:120]}"))
        except (httpx.HTTPError, ValueError) as exc:
            out.append(Check(what, False, f"{type(exc).__name__}: {exc}"))
    if spec.prometheus_file_sd:
        out.append(_writable("Prometheus file discovery", spec.prometheus_file_sd))
    if spec.gateway is not None:
        out.append(_writable(f"gateway ({spec.gateway.kind})", spec.gateway.directory))
        if spec.gateway.kind == "nginx":
            cmd = spec.gateway.reload_command[0] if spec.gateway.reload_command else ""
            found = shutil.which(cmd) if cmd else None
            out.append(Check("gateway reload command", found is not None,
                             found or f"{cmd or '(empty)'} is not on PATH: nginx is reloaded on another host? run "
                                      "koi fleet gateway there"))
    return out
