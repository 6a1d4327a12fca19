"""The exceptions the client raises, and the mapping from gRPC statuses to them.

Every exception is a :class:`ProvisioningError` carrying the gRPC status code
(``None`` when no status applies, e.g. :class:`Stalled`), a message for people
and, for a rejected argument, the path of the offending field as the driver
names it (``shape.groups[0].count``).

Secret parameter values never appear in a message or a ``repr``: the driver
never echoes one, and the client additionally replaces every secret value of
the shape it sent with ``<redacted>`` in any message about that request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import grpc

#: What a secret value is replaced with, as the driver does on its read paths.
REDACTED = "<redacted>"

#: The metadata key of gRPC's retry hint (milliseconds), sent by the driver
#: with a call it sheds or rate-limits.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class ProvisioningError(Exception):
    """A failed call, or a failure found before anything was sent.

    ``status_code`` is the ``grpc.StatusCode`` the failure corresponds to
    (``None`` for :class:`Stalled`); ``message`` says what went wrong;
    ``field`` is the path of the field at fault, when a field is.
    """

    def __init__(self, status_code: grpc.StatusCode | None, message: str, field: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        code = self.status_code.name if self.status_code is not None else None
        return f"{type(self).__name__}(status_code={code}, message={self.message!r}, field={self.field!r})"


class InvalidArgument(ProvisioningError):
    """``INVALID_ARGUMENT``: a request field is wrong (``field`` names it). Nothing changed."""


class InvalidShape(InvalidArgument):
    """A shape the driver (or the client, before sending it) refuses.

    ``field`` is the path of the offending field, e.g.
    ``shape.groups[0].template.provider.name``. Nothing changed.
    """


class NotFound(ProvisioningError):
    """``NOT_FOUND``: no such run (or node)."""


class Conflict(ProvisioningError):
    """``FAILED_PRECONDITION`` or ``ALREADY_EXISTS``: the request contradicts the
    run's state (a generation that went down, the same generation with other
    content, an apply to a run being deleted). Nothing changed."""


class Unauthenticated(ProvisioningError):
    """``UNAUTHENTICATED``: no credentials, or ones the driver does not accept."""


class PermissionDenied(ProvisioningError):
    """``PERMISSION_DENIED``: the credentials do not allow this call or this run."""


class Unavailable(ProvisioningError):
    """``UNAVAILABLE``: the driver cannot be reached, or a service behind it is down.

    For a change (apply, delete, pause, resume, promote) this is raised only
    when the request certainly did not take effect; otherwise
    :class:`OutcomeUnknown` is.
    """


class ResourceExhausted(ProvisioningError):
    """``RESOURCE_EXHAUSTED``: over one of the driver's limits. Nothing changed
    (the driver refuses before any handler runs), so a change refused this
    way may be sent again once ``retry_after`` has passed.

    ``retry_after`` is the wait in seconds the driver suggested
    (``grpc-retry-pushback-ms``), or ``None``.
    """

    def __init__(
        self,
        status_code: grpc.StatusCode | None,
        message: str,
        field: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(status_code, message, field)
        self.retry_after = retry_after


class OutcomeUnknown(ProvisioningError):
    """A change was sent, then the connection broke or the deadline passed
    before the answer came: it may or may not have taken effect.

    Check with :meth:`Client.get` before trying again. ``status_code`` is the
    code the transport reported.
    """


class Timeout(ProvisioningError):
    """``DEADLINE_EXCEEDED`` on a read, or a wait or watch that ran out of time."""


class Stalled(ProvisioningError):
    """:meth:`Client.wait`: the run is stalled (its ``Stalled`` condition is
    true); nothing more happens until its shape changes. ``status`` is the
    run's last status."""

    def __init__(self, message: str, status=None):
        super().__init__(None, message)
        self.status = status


_BY_CODE: dict[grpc.StatusCode, type[ProvisioningError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
}

# Codes a broken connection is reported with by the gRPC library itself.
_TRANSPORT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
    }
)

# How the gRPC library words a connection that was never made: nothing was sent.
_NOT_CONNECTED = (
    "failed to connect to all addresses",
    "connection refused",
    "dns resolution failed",
    "name resolution failure",
    "failed to connect to remote host",
    "no address",
)


def _code(err: grpc.RpcError) -> grpc.StatusCode:
    code = getattr(err, "code", None)
    value = code() if callable(code) else None
    return value if isinstance(value, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def _details(err: grpc.RpcError) -> str:
    details = getattr(err, "details", None)
    value = details() if callable(details) else None
    return value if isinstance(value, str) else ""


def _metadata(err: grpc.RpcError, name: str) -> tuple:
    method = getattr(err, name, None)
    value = method() if callable(method) else None
    return tuple(value or ())


def sent_by_server(err: grpc.RpcError) -> bool:
    """Whether the status came from the server rather than from the local gRPC
    library. A status the server sends arrives with response metadata (at
    least the HTTP headers of its response); one the library makes up for a
    broken or missing connection has none."""
    return bool(_metadata(err, "trailing_metadata") or _metadata(err, "initial_metadata"))


def never_connected(err: grpc.RpcError) -> bool:
    """Whether the call failed because no connection could be made, so that
    the request was certainly not sent."""
    if _code(err) != grpc.StatusCode.UNAVAILABLE or sent_by_server(err):
        return False
    text = _details(err).lower()
    return any(marker in text for marker in _NOT_CONNECTED)


def outcome_unknown(err: grpc.RpcError) -> bool:
    """Whether a failed *change* may still have taken effect: the deadline
    passed (the driver may have acted before it), or the connection broke
    after the request went out. A status the server sent is a definite answer
    (a rejected request changes nothing), and a connection never made sent
    nothing."""
    code = _code(err)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    if code not in _TRANSPORT_CODES or sent_by_server(err):
        return False
    return not never_connected(err)


def retry_pushback(err: grpc.RpcError) -> float | None:
    """The driver's retry hint in seconds, from the ``grpc-retry-pushback-ms``
    trailer; ``None`` without one. A malformed or negative hint means "do not
    retry" in gRPC's retry design and is returned as ``-1.0``."""
    for key, value in _metadata(err, "trailing_metadata"):
        if key == RETRY_PUSHBACK_KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return -1.0
            return ms / 1000.0 if ms >= 0 else -1.0
    return None


_PATH_START = re.compile(r"[A-Za-z_]")
_PATH_CHARS = re.compile(r"[A-Za-z0-9_]")


def field_of(message: str) -> str | None:
    """The field path a driver message starts with (``shape.groups[1].count
    must not be negative`` gives ``shape.groups[1].count``), or ``None`` when
    it starts with no path.

    A path is dotted names with bracketed indices or quoted keys
    (``shape.groups[0].template.boot["a key"]``). A single plain word counts
    only if it has an underscore (``run_id``) or is ``shape``, so a sentence
    that merely starts with a word is not taken for a field.
    """
    text = message.strip()
    i = 0
    n = len(text)
    if n == 0 or not _PATH_START.match(text[0]):
        return None
    while i < n:
        c = text[i]
        if _PATH_CHARS.match(c):
            i += 1
        elif c == "." and i + 1 < n and _PATH_START.match(text[i + 1]):
            i += 1
        elif c == "[":
            end = _bracket_end(text, i)
            if end < 0:
                return None
            i = end + 1
        else:
            break
    path = text[:i]
    rest = text[i:]
    if rest and not (rest[0].isspace() or rest[0] == ":"):
        return None
    if not rest.strip(" :"):
        return None
    simple = all(_PATH_CHARS.match(c) for c in path)
    if simple and "_" not in path and path != "shape":
        return None
    return path


def _bracket_end(text: str, start: int) -> int:
    """The index of the ``]`` closing the bracket at ``start`` (a quoted key may
    hold any character, with backslash escapes), or -1."""
    i = start + 1
    if i < len(text) and text[i] == '"':
        i += 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                break
            i += 1
        i += 1
    while i < len(text) and text[i] != "]":
        if text[i] in " \t\n":
            return -1
        i += 1
    return i if i < len(text) else -1


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each (non-empty) secret replaced by
    ``<redacted>``, the longest first so that one secret containing another
    is hidden whole."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def from_rpc_error(
    err: grpc.RpcError,
    doing: str,
    *,
    change: bool = False,
    shape: bool = False,
    secrets: Iterable[str] = (),
    check_with: str | None = None,
) -> ProvisioningError:
    """The exception for a failed call.

    ``doing`` says what was asked (``apply run demo``) and starts the message.
    ``change`` marks a call that changes something: a failure that leaves its
    outcome unknown is then :class:`OutcomeUnknown`, telling to check with
    ``check_with`` (e.g. ``get("demo")``). ``shape`` marks a call carrying a
    shape, whose ``INVALID_ARGUMENT`` is :class:`InvalidShape`. ``secrets`` are
    the secret values the request carried, hidden from the message.
    """
    code = _code(err)
    details = _details(err)
    message = scrub(details, secrets)
    if change and outcome_unknown(err):
        why = "the call timed out" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "the connection broke"
        check = f"check with {check_with}" if check_with else "check the run's state"
        return OutcomeUnknown(
            code,
            f"{doing}: the outcome is unknown: the request was sent, then {why} before the answer came "
            f"({message}); it may or may not have taken effect: {check} before trying again",
        )
    cls = _BY_CODE.get(code, ProvisioningError)
    text = f"{doing}: {message}" if message else f"{doing}: {code.name}"
    if cls is InvalidArgument:
        cls = InvalidShape if shape else InvalidArgument
        return cls(code, text, field_of(details))
    if cls is ResourceExhausted:
        after = retry_pushback(err)
        return ResourceExhausted(code, text, None, after if after is not None and after >= 0 else None)
    if cls is Unavailable and never_connected(err):
        text += " (nothing was sent)"
    return cls(code, text)
