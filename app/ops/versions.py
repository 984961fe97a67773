"""Policy versions at the edge: a request may pin the version its model work runs on
(`X-Min-Policy-Version`, or exactly `X-Policy-Version`; checked at admission,
`app.engine.pins`), and every answer of a request whose work was admitted says the version
it was admitted at and the one served when its answer began, with that version's digest:

- `X-Policy-Version-Start`: the version at admission;
- `X-Policy-Version-End`: the version served as the answer begins (a streamed answer's
  headers go first: its tokens' own versions say the rest);
- `X-Policy-Digest`: the digest of the weights served then (`rlserve_client.weight_delta`).

Headers, not body fields, so that every route, in every vocabulary (rlserve's, OpenAI's,
vLLM's, SGLang's), pins and reports the same way."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.engine import pins
from app.engine.types import MAX_VERSION
from app.errors import APIError, error_response
from app.words import PIN_EXACT, PIN_MINIMUM

STARTED = b"x-policy-version-start"
ENDED = b"x-policy-version-end"
DIGEST = b"x-policy-digest"


class VersionPinMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            pin = pins.Pin(
                minimum=_version(headers, PIN_MINIMUM),
                exact=_version(headers, PIN_EXACT),
            )
        except APIError as problem:
            await error_response(problem)(scope, receive, send)
            return
        noted = pins.Noted(pin=pin)
        token = pins.REQUEST.set(noted)

        async def send_versions(message: Message) -> None:
            if message["type"] == "http.response.start" and noted.admitted is not None:
                registry = scope["app"].state.registry
                digest = registry.digests.of("policy")
                stamp = [
                    (STARTED, str(noted.admitted).encode()),
                    (ENDED, str(registry.policy_version).encode()),
                ]
                if digest is not None:
                    stamp.append((DIGEST, digest.encode()))
                message["headers"] = [*message.get("headers", []), *stamp]
            await send(message)

        try:
            await self.app(scope, receive, send_versions)
        finally:
            pins.REQUEST.reset(token)


def _version(headers: Headers, name: str) -> int | None:
    given = headers.get(name)
    if given is None:
        return None
    text = given.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 16 or int(text) > MAX_VERSION:
        raise APIError(
            422, f"{name}: '{given[:32]}' is not a version (0 to {MAX_VERSION})", param=name
        )
    return int(text)
