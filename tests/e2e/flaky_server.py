"""A server that answers 503 to the first two requests of each path, then 200: the client's
retries are tested against a real socket with it."""

from __future__ import annotations

from collections import Counter

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()
seen: Counter[str] = Counter()


@app.api_route("/{path:path}", methods=["GET", "POST"])
async def flaky(path: str, request: Request) -> JSONResponse:
    seen[path] += 1
    if path == "count":
        return JSONResponse({"seen": dict(seen)})
    if seen[path] <= 2:
        error = {"message": "warming up", "type": "overloaded_error", "param": None, "code": 503}
        return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "0"})
    return JSONResponse({"status": "ok", "model_status": "ready"})
