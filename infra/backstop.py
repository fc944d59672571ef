"""The release backstop: an instance Koi drained releases itself when no Koi worker does.

A torn-down rank, or a replica a scale-in removed, is released by the worker's drain sweep (:mod:`infra.drain`). While
no worker runs — a deploy gone wrong, the worker's host lost over a weekend — nothing sweeps, and a drained GPU node
kept running and billing until one returned. So every deferred release also writes the latest time it can be due,
``release-by`` (an EC2/Azure tag ``koi:release-by``, GCE metadata ``koi-release-by``; whole epoch seconds), and the
start-up script Koi renders (:mod:`infra.engine`) runs a watchdog beside the engine: once a minute it reads its own
instance's ``release-by`` from the cloud's instance metadata and, once that time has passed, releases the instance.
A live instance carries no ``release-by``: serving goes on while the control plane is down.

Choices (the spec's port says only "drain then release"):

1. **When**: ``release-by`` = the latest moment the sweep could release the rank — the teardown's time, plus the
   handover timeout when it hands over, plus its drain — plus :data:`RELEASE_GRACE_S` (10 min), so a running worker
   (sweeping every few seconds) always releases first and clock skew between the worker and the instance cannot
   cut a drain short. A scale-in's replica: the end of its drain plus the grace.
2. **How an instance releases itself**, per cloud:
   - **EC2**: ``shutdown -h now``; Koi launches with ``InstanceInitiatedShutdownBehavior=terminate``, so EC2
     terminates it. The tag is read through the instance metadata (``InstanceMetadataTags``, enabled on every
     instance Koi starts an engine on).
   - **Compute Engine**: a ``DELETE`` of itself with its service account's token from the metadata server (the
     account needs the ``cloud-platform`` or ``compute`` scope and ``compute.instances.delete``); when it may not
     delete instances, ``shutdown -h now`` — a stopped (``TERMINATED``) instance holds no GPU
     and is not billed for one; the next sweep deletes it.
   - **Azure**: a guest shutdown leaves the VM allocated and billed, so only a ``DELETE`` through Resource Manager
     releases it: with a user-assigned managed identity in the fleet file (``azure.identity``, allowed to delete
     the group's VMs) the VM takes a token for it from the instance metadata and deletes itself (its NIC and disk go
     with it). Without an identity no watchdog is rendered; ``docs/OPS.md`` says so.
3. A failed release is tried again at the next check; the watchdog never touches the engine before its time.
"""

from __future__ import annotations

import math
import shlex
from typing import Literal

from infra.drain import HANDOVER_TIMEOUT_S, Drain
from infra.engine import IMDS_HELPERS

#: How long after the sweep's latest release time an instance releases itself (s; choice 1).
RELEASE_GRACE_S = 600.0
#: How often the watchdog reads its instance's ``release-by`` (s); ``KOI_WATCH_EVERY_S`` overrides it.
WATCH_EVERY_S = 60
AZURE_API = "2024-07-01"

Cloud = Literal["aws", "gcp", "azure"]


def release_by(d: Drain) -> str:
    """The ``release-by`` value of a drained rank: whole epoch seconds, rounded up (choice 1)."""
    start = d.started if d.started is not None else d.at + (HANDOVER_TIMEOUT_S if d.handover else 0.0)
    return str(math.ceil(start + d.drain_s + RELEASE_GRACE_S))


def replica_release_by(until: float) -> str:
    """The ``release-by`` value of a replica a scale-in drains until ``until``."""
    return str(math.ceil(until + RELEASE_GRACE_S))


_READ = {
    "aws": "koi_release_by() { koi_imds meta-data/tags/instance/koi:release-by; }",
    "gcp": """koi_gce() { curl -sf -H 'Metadata-Flavor: Google' "http://metadata.google.internal/computeMetadata/v1/$1"; }
koi_release_by() { koi_gce instance/attributes/koi-release-by; }""",
    "azure": """koi_azure() { curl -sf -H Metadata:true "http://169.254.169.254/metadata/$1"; }
koi_release_by() {
  koi_azure 'instance/compute/tagsList?api-version=2021-02-01' | "${KOI_PYTHON:-python3}" -c 'import json, sys
v = [t["value"] for t in json.load(sys.stdin) if t["name"] == "koi:release-by"]
sys.exit(1) if not v else print(v[0])'
}""",
}
_TOKEN = """sed -n 's/.*"access_token" *: *"\\([^"]*\\)".*/\\1/p'"""


def _release(cloud: Cloud, identity: str | None) -> str:
    if cloud == "aws":
        return "koi_release_self() { shutdown -h now; }  # InstanceInitiatedShutdownBehavior=terminate"
    if cloud == "gcp":
        return f"""koi_release_self() {{  # delete itself; without the right to, stop (a stopped instance holds no GPU)
  local tok zone name project
  tok=$(koi_gce instance/service-accounts/default/token | {_TOKEN})
  zone=$(koi_gce instance/zone) && name=$(koi_gce instance/name) && project=$(koi_gce project/project-id) &&
    curl -sf -X DELETE -H "Authorization: Bearer $tok" \\
      "https://compute.googleapis.com/compute/v1/projects/$project/zones/${{zone##*/}}/instances/$name" >/dev/null ||
    shutdown -h now
}}"""
    assert identity is not None
    token = f"identity/oauth2/token?api-version=2018-02-01&resource=https://management.azure.com/&msi_res_id={identity}"
    return f"""koi_release_self() {{  # delete itself through Resource Manager with the fleet's managed identity
  local tok rid
  tok=$(koi_azure {shlex.quote(token)} | {_TOKEN})
  rid=$(koi_azure 'instance/compute/resourceId?api-version=2021-02-01&format=text') &&
    curl -sf -X DELETE -H "Authorization: Bearer $tok" "https://management.azure.com$rid?api-version={AZURE_API}" >/dev/null
}}"""


def standalone(cloud: Cloud, log_file: str, identity: str | None = None) -> str | None:
    """The watchdog as a script of its own, for an image or user data of the operator's (no ``engine:`` in the fleet
    file): ``koi fleet backstop-script``. None where :func:`watchdog` is."""
    body = watchdog(cloud, log_file, identity)
    if body is None:
        return None
    start = "koi_watchdog </dev/null >/dev/null 2>&1 &"
    assert body.endswith(start)
    head = ["#!/bin/bash", "# Koi's release backstop (infra/backstop.py): run it at boot, as root (it may shut the "
            "instance down).", "# It goes on in the background; with --foreground it stays in front (a systemd "
            "unit's ExecStart)."]
    tail = f'if [ "${{1:-}}" = --foreground ]; then koi_watchdog; else {start} fi'
    return "\n".join([*head, *([IMDS_HELPERS] if cloud == "aws" else []), body.removesuffix(start).rstrip("\n"),
                      tail]) + "\n"


def watchdog(cloud: Cloud, log_file: str, identity: str | None = None) -> str | None:
    """The shell that starts the watchdog in the background (before the engine's ``exec``), or None where an
    instance cannot release itself (Azure without an identity, choice 2). On EC2 it needs ``koi_imds``
    (:mod:`infra.engine`'s metadata helpers)."""
    if cloud == "azure" and not identity:
        return None
    log_to = shlex.quote(log_file)
    return "\n".join([_READ[cloud], _release(cloud, identity), f"""koi_watchdog() {{  # the release backstop (infra/backstop.py)
  local by
  while sleep "${{KOI_WATCH_EVERY_S:-{WATCH_EVERY_S}}}"; do
    by=$(koi_release_by) || continue
    [[ "$by" =~ ^[0-9]+$ ]] || continue
    if (( $(date +%s) >= by )); then
      echo "koi: past release-by $by and no worker released this instance: releasing it" >> {log_to} || true
      koi_release_self && return 0
    fi
  done
}}
koi_watchdog </dev/null >/dev/null 2>&1 &"""])
