"""What can go wrong below the HTTP layer, in domain terms. Services and engines raise these;
`app.errors` maps each kind to its status and error type in one table, so no code below the
routes decides an HTTP status."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping


class Failure(Exception):
    """A failure the caller caused or must wait out; `param` names the request field at fault
    (or a role, which the route that called names in its own words: `worded`)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def reword(self, words: Mapping[str, str]) -> None:
        """Name the caller's field in place of the role `param` is, when `words` names it
        (the message's leading role too)."""
        if self.param is None or (word := words.get(self.param)) is None:
            return
        if self.message.startswith(self.param):
            self.message = word + self.message[len(self.param) :]
        self.param = word
        self.args = (self.message,)


class InvalidInput(Failure):
    """The request is well-formed but its values cannot be served."""


class Unsupported(Failure):
    """A valid request this deployment cannot serve (model kind, backend feature)."""


class Malformed(Failure):
    """A payload that is not what it claims to be (e.g. not a safetensors checkpoint)."""


class NotFound(Failure):
    """The named thing does not exist, or belongs to another API key."""


class Forbidden(Failure):
    """The named thing is another API key's to change (a trainer's LoRA adapter)."""


class Conflict(Failure):
    """The request does not fit the current state (episode done, not reset yet)."""


class Superseded(Conflict):
    """Another server changed the state while this request ran; nothing was applied, and the
    same request with the same Idempotency-Key may be sent again."""


class VersionBehind(Conflict):
    """The request pins a policy version later than the one served: nothing was started, and
    it may be sent again (another replica, or this one after its next update, may serve it)."""


class VersionPassed(Conflict):
    """The request pins a policy version this server served before: it never comes back."""


class TooLarge(Failure):
    """The request asks for more than the server's limits allow in one call."""


class QuotaExceeded(Failure):
    """The caller holds too much already (live sessions)."""


class NotReady(Failure):
    """The service cannot take this now (model loading or failed, tool sandbox missing)."""


class Paused(NotReady):
    """Serving (or an adapter) stayed paused for longer than a request may wait for it: the
    request was not started, and may be sent again later."""


class TimedOut(Failure):
    """Work on the request's behalf (e.g. reading a checkpoint) ran out of time."""


class PeerAbsent(Conflict):
    """The trainer a request named did not take part (it never joined a transfer group in
    time): the caller's failure, not the server's."""


class PeerFailed(Failure):
    """The other side of a collective (a trainer in a weight transfer) failed or went away."""


def invalid(param: str, message: str) -> InvalidInput:
    """An InvalidInput naming `param`, its message prefixed by it."""
    return InvalidInput(f"{param}: {message}", param=param)


def file_failure(error: OSError, param: str) -> Failure:
    """A file call on a path the request named (field `param`) that failed: the client's
    failure, named, never a 500. None there (404), not the server's to read (403), else a
    path the server cannot use (422, with the system's reason)."""
    where = error.filename if error.filename is not None else "the path"
    reason = error.strerror or type(error).__name__
    if isinstance(error, FileNotFoundError):
        return NotFound(f"{param}: {where} does not exist on the server", param=param)
    if isinstance(error, PermissionError):
        return Forbidden(f"{param}: the server may not read {where} ({reason})", param=param)
    return invalid(param, f"the server cannot use {where}: {reason}")


@contextlib.contextmanager
def worded(words: Mapping[str, str]) -> Iterator[None]:
    """Failures raised inside that name one of the roles in `words` (the core's names for what
    a request carries, e.g. `app.weights.lora.ADAPTER`) name the caller's field instead: each
    route maps the roles to its own vocabulary's words."""
    try:
        yield
    except Failure as exc:
        exc.reword(words)
        raise
