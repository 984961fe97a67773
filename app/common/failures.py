"""What can go wrong below the HTTP layer, in domain terms. Services and engines raise these;
`app.errors` maps each kind to its status and error type in one table, so no code below the
routes decides an HTTP status."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping

from app.common.roles import Role


class Failure(Exception):
    """A failure the caller caused or must wait out. At the edge, `param` names the request
    field at fault and the message is whole. Below it, `role` names what is at fault in the
    core's terms (and `index`, which of a list's items) and the message is the reason alone:
    the route that called words the role (`word`), and the field and message are composed
    from its word and the reason."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        role: Role | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = self.message = message
        self.param, self.role, self.index = param, role, index
        if role is not None:
            self._name(str(role))

    def _name(self, field: str) -> str:
        """Name `field` (and the item's index) in the message; the name."""
        named = field if self.index is None else f"{field}[{self.index}]"
        self.message = f"{named}: {self.reason}"
        self.args = (self.message,)
        return named

    def word(self, words: Mapping[Role, str]) -> None:
        """Name the role in `words`' terms, when they name it and no route has yet: the
        field, and the message composed as `field: reason`."""
        if self.role is None or self.param is not None or (field := words.get(self.role)) is None:
            return
        self.param = self._name(field)

    def noted(self, context: str) -> Failure:
        """The same failure, `context` appended to its reason."""
        again = copy.copy(self)
        again.reason, again.message = f"{self.reason} ({context})", f"{self.message} ({context})"
        again.args = (again.message,)
        return again

    def recast(self, roles: Mapping[Role, Role]) -> None:
        """Name another role in place of this one, where `roles` maps it (a step that gives a
        lower step's failure its own meaning, e.g. an adapter's size at a transfer)."""
        if self.role is not None and self.param is None and self.role in roles:
            self.role = roles[self.role]
            self._name(str(self.role))

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled whole (a Ray replica's failure reaches the router with its role)."""
        state = (self.reason, self.param, self.role, self.index, self.message)
        return (_rebuilt, (type(self), *state))


def _rebuilt(
    kind: type[Failure],
    reason: str,
    param: str | None,
    role: Role | None,
    index: int | None,
    message: str,
) -> Failure:
    failure = kind(reason, role=role, index=index)
    failure.param, failure.message, failure.args = param, message, (message,)
    return failure


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


def invalid(at: str | Role, message: str, *, index: int | None = None) -> InvalidInput:
    """An InvalidInput naming a request field (its message prefixed by it) or a role (and
    which of its items)."""
    if isinstance(at, Role):
        return InvalidInput(message, role=at, index=index)
    return InvalidInput(f"{at}: {message}", param=at)


def file_failure(error: OSError, role: Role) -> Failure:
    """A file call on a path the request named (as `role`) that failed: the client's failure,
    named, never a 500. None there (404), not the server's to read (403), else a path the
    server cannot use (422, with the system's reason)."""
    where = error.filename if error.filename is not None else "the path"
    reason = error.strerror or type(error).__name__
    if isinstance(error, FileNotFoundError):
        return NotFound(f"{where} does not exist on the server", role=role)
    if isinstance(error, PermissionError):
        return Forbidden(f"the server may not read {where} ({reason})", role=role)
    return InvalidInput(f"the server cannot use {where}: {reason}", role=role)


@contextlib.contextmanager
def worded(words: Mapping[Role, str]) -> Iterator[None]:
    """Failures raised inside that name one of the roles in `words` name the caller's field
    for it: each route maps the roles to its own vocabulary's words (the innermost route that
    words a role names it)."""
    try:
        yield
    except Failure as exc:
        exc.word(words)
        raise


@contextlib.contextmanager
def recast(roles: Mapping[Role, Role]) -> Iterator[None]:
    """Failures raised inside that name one of the roles in `roles` name its image instead."""
    try:
        yield
    except Failure as exc:
        exc.recast(roles)
        raise
