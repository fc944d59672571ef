"""``koi version``: Koi's version and the components it stands on."""

from __future__ import annotations

import json
from importlib.metadata import version

from typer.testing import CliRunner

from koi.cli import app


def test_koi_version_names_the_components_an_operator_debugs_against():
    r = CliRunner().invoke(app, ["version", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["koi"] and doc["temporalio"] == version("temporalio")
    assert doc["boto3"] == version("boto3") and doc["google-cloud-compute"] == version("google-cloud-compute")
    assert doc["azure-mgmt-compute"] == version("azure-mgmt-compute")
