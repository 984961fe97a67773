from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from rlserve_client import AsyncClient


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[AsyncClient]:
    """The Python client against the real app in-process."""
    transport = httpx.ASGITransport(app=app)
    async with AsyncClient(base_url="http://rlserve", transport=transport) as client:
        yield client
