"""The client of the driver's public API, ``provisioning.v1.Provisioning``.

Every method returns the protobuf message the driver answers with (the
classes of :data:`provisioning_client.pb`), or a list of them, and raises a
:class:`~provisioning_client.errors.ProvisioningError` subclass on failure.

Reads (``get``, ``list``, ``explain``, ``events``, ``providers``, ``plan`` and
the opening of a ``watch``) are retried on ``UNAVAILABLE`` and
``RESOURCE_EXHAUSTED`` with exponential backoff, waiting as long as the
driver's ``grpc-retry-pushback-ms`` trailer asks when it sends one, within the
call's timeout. Changes (``apply``, ``delete``, ``pause``, ``resume``,
``promote``) are sent once: a change whose answer was lost raises
:class:`~provisioning_client.errors.OutcomeUnknown`, and only the caller can
decide whether sending it again is right.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory

from . import __version__, _protos
from .errors import (
    Conflict,
    InvalidArgument,
    InvalidShape,
    NotFound,
    Stalled,
    Timeout,
    Unavailable,
    from_rpc_error,
    retry_pushback,
)
from .shape import load_shape_file, same_content, secret_values, shape_to_proto

pb = _protos.load()

__all__ = ["Client", "TlsConfig", "settings_from_env", "parse_bool"]

#: The only service this client calls. The proto file also defines the
#: internal ``Decider`` and ``Executor`` services; no call of theirs is built.
SERVICE = "provisioning.v1.Provisioning"

#: The driver's address when ``PROVISIONCTL_SERVER`` is not set (as provisionctl).
DEFAULT_SERVER = "127.0.0.1:7000"

#: The largest answer accepted: the driver's default ``--max-send-message-bytes``
#: (a large run's status with its nodes is big; gRPC's own default is 4 MiB).
MAX_RECEIVE_BYTES = 64 * 1024 * 1024

# Environment variables, named as provisionctl names them.
ENV_SERVER = "PROVISIONCTL_SERVER"
ENV_TLS_CA = "PROVISIONCTL_TLS_CA"
ENV_TLS_CERT = "PROVISIONCTL_TLS_CERT"
ENV_TLS_KEY = "PROVISIONCTL_TLS_KEY"
ENV_TOKEN_FILE = "PROVISIONCTL_TOKEN_FILE"
ENV_TOKEN = "PROVISIONCTL_TOKEN"
ENV_INSECURE = "PROVISIONCTL_INSECURE"

_TRUE = frozenset({"1", "true", "yes", "y", "t", "on"})
_FALSE = frozenset({"0", "false", "no", "n", "f", "off"})

# Backoff between attempts of a read (seconds): doubling from the base up to
# the cap, each a random 50-100% of that, so that many clients spread out.
_BACKOFF_BASE = 0.1
_BACKOFF_CAP = 3.0


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the driver: ``ca`` is the CA bundle (PEM file) the driver's
    certificate is verified against (``None``: the system's roots); ``cert``
    and ``key`` (PEM files, both or neither) are a client certificate to
    present."""

    ca: str | os.PathLike | None = None
    cert: str | os.PathLike | None = None
    key: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TlsConfig: give cert and key together (a client certificate and its key)")

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials, reading the files now."""

        def read(path: str | os.PathLike | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


def parse_bool(value: str, name: str = "value") -> bool:
    """A boolean as provisionctl reads one from the environment: ``1/0``,
    ``true/false``, ``yes/no``, ``on/off`` (also ``y/n``, ``t/f``), in any
    case. Raises ``ValueError`` naming ``name`` otherwise."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :class:`Client` arguments the provisionctl environment variables give.

    ``PROVISIONCTL_SERVER`` (default ``127.0.0.1:7000``); TLS when
    ``PROVISIONCTL_TLS_CA`` is set, with the client certificate
    ``PROVISIONCTL_TLS_CERT`` and ``PROVISIONCTL_TLS_KEY`` (both or neither);
    plaintext when ``PROVISIONCTL_INSECURE`` is true; the bearer token from
    the file ``PROVISIONCTL_TOKEN_FILE``, else ``PROVISIONCTL_TOKEN`` itself.
    An empty variable counts as unset. provisionctl's configuration-file
    contexts are not read.
    """
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        value = env.get(name)
        return value if value is not None and value.strip() != "" else None

    settings: dict[str, Any] = {"target": get(ENV_SERVER) or DEFAULT_SERVER}
    insecure = get(ENV_INSECURE)
    settings["insecure"] = parse_bool(insecure, ENV_INSECURE) if insecure is not None else False
    ca, cert, key = get(ENV_TLS_CA), get(ENV_TLS_CERT), get(ENV_TLS_KEY)
    if (cert is None) != (key is None):
        raise ValueError(f"{ENV_TLS_CERT} and {ENV_TLS_KEY} go together: set both or neither")
    if ca is not None:
        settings["tls"] = TlsConfig(ca=ca, cert=cert, key=key)
    token_file = get(ENV_TOKEN_FILE)
    if token_file is not None:
        settings["token_file"] = token_file
    elif get(ENV_TOKEN) is not None:
        settings["token"] = get(ENV_TOKEN)
    return settings


def _check_token(token: str, source: str) -> str:
    token = token.strip()
    if not token:
        raise ValueError(f"{source}: the token is empty")
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ValueError(f"{source}: the token is not printable ASCII text without spaces")
    return token


def _address(target: str, secure: bool) -> str:
    """``host:port`` from ``host:port`` or a URL whose scheme matches the transport."""
    t = target.strip()
    if "://" not in t:
        if not t:
            raise ValueError("the target is empty: give the driver's host:port")
        return t
    scheme, rest = t.split("://", 1)
    scheme = scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"{target}: the scheme must be http:// (plaintext) or https:// (TLS)")
    if scheme == "http" and secure:
        raise ValueError(f"{target}: an http:// address with TLS configured; use https:// or host:port")
    if scheme == "https" and not secure:
        raise ValueError(f"{target}: an https:// address with insecure=True; use http:// or host:port")
    rest = rest.rstrip("/")
    if not rest or "/" in rest:
        raise ValueError(f"{target}: give the address as scheme://host:port, without a path")
    if ":" not in rest.rsplit("]", 1)[-1]:
        rest += ":443" if scheme == "https" else ":80"
    return rest


def _condition(status, kind: str):
    """The run status's condition of type ``kind``, or ``None``."""
    for c in status.conditions:
        if c.type == kind:
            return c
    return None


class Client:
    """A connection to a driver's public API.

    ``target`` is ``host:port`` or a URL (``http://`` for plaintext,
    ``https://`` for TLS). The transport is TLS with ``tls`` or plaintext with
    ``insecure=True``; exactly one must be chosen, as with provisionctl.
    ``token`` (or the file ``token_file``) is the bearer token sent on every
    call as ``authorization: Bearer <token>``. ``timeout`` is each call's
    deadline in seconds (reads: for all their attempts together);
    ``retries`` is how many times more a read is tried.

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        target: str,
        *,
        tls: TlsConfig | None = None,
        token: str | None = None,
        token_file: str | os.PathLike | None = None,
        insecure: bool = False,
        timeout: float = 30.0,
        retries: int = 4,
    ):
        if tls is not None and insecure:
            raise ValueError("insecure=True (plaintext) cannot be combined with tls: choose one")
        if tls is None and not insecure:
            raise ValueError(
                "no transport chosen: give tls=TlsConfig(ca=...) to reach the driver over TLS, "
                "or insecure=True for a driver that serves plaintext"
            )
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = _check_token(Path(token_file).read_text(encoding="utf-8"), f"token file {token_file}")
        elif token is not None:
            token = _check_token(token, "token")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if retries < 0:
            raise ValueError("retries must not be negative")
        self.target = target
        self.timeout = float(timeout)
        self.retries = int(retries)
        self._secure = tls is not None
        self._metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        address = _address(target, self._secure)
        options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.primary_user_agent", f"provisioning-client-python/{__version__}"),
        ]
        if tls is not None:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._calls = self._build_calls()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Client:
        """A client configured as provisionctl is, from its environment
        variables (see :func:`settings_from_env`); ``overrides`` are
        :class:`Client` arguments that win over them."""
        settings = settings_from_env(environ)
        if "token" in overrides or "token_file" in overrides:
            settings.pop("token", None)
            settings.pop("token_file", None)
        if "tls" in overrides or "insecure" in overrides:
            settings.pop("tls", None)
            settings.pop("insecure", None)
        settings.update(overrides)
        return cls(**settings)

    def _build_calls(self) -> dict[str, Any]:
        service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
        calls = {}
        for method in service.methods:
            request = message_factory.GetMessageClass(method.input_type)
            response = message_factory.GetMessageClass(method.output_type)
            path = f"/{SERVICE}/{method.name}"
            make = self._channel.unary_stream if method.server_streaming else self._channel.unary_unary
            calls[method.name] = make(
                path,
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
        return calls

    def __repr__(self) -> str:
        token = "<redacted>" if self._metadata else None
        transport = "tls" if self._secure else "insecure"
        return f"Client(target={self.target!r}, transport={transport}, token={token}, timeout={self.timeout})"

    def close(self) -> None:
        """Closes the connection; calls in flight end with ``CANCELLED``."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calling -------------------------------------------------------------

    def _retry_delay(self, err: grpc.RpcError, attempt: int) -> float | None:
        """How long to wait before trying a read again, or ``None`` not to."""
        code = err.code() if callable(getattr(err, "code", None)) else None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return None
        if attempt >= self.retries:
            return None
        pushback = retry_pushback(err)
        if pushback is not None:
            return None if pushback < 0 else pushback
        return min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt) * random.uniform(0.5, 1.0)

    def _read(self, method: str, request, doing: str, *, shape_secrets: list[str] | None = None):
        """A read, retried (see the module documentation)."""
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                return self._calls[method](request, timeout=remaining, metadata=self._metadata)
            except grpc.RpcError as err:
                delay = self._retry_delay(err, attempt)
                if delay is None or time.monotonic() + delay >= deadline:
                    raise from_rpc_error(
                        err, doing, shape=shape_secrets is not None, secrets=shape_secrets or ()
                    ) from None
                attempt += 1
                time.sleep(delay)

    def _change(self, method: str, request, doing: str, run_id: str, *, secrets: list[str] | None = None):
        """A change, sent once."""
        try:
            return self._calls[method](request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(
                err,
                doing,
                change=True,
                shape=secrets is not None,
                secrets=secrets or (),
                check_with=f"get({run_id!r})",
            ) from None

    # -- shapes --------------------------------------------------------------

    @staticmethod
    def _shape_message(shape) -> Any:
        if isinstance(shape, pb.ClusterShape):
            msg = pb.ClusterShape()
            msg.CopyFrom(shape)
            return msg
        if isinstance(shape, Mapping):
            return shape_to_proto(shape)
        raise TypeError(
            f"a shape is a mapping in the shape-file format or a ClusterShape message, not {type(shape).__name__}"
            " (apply_file reads a file)"
        )

    def _current(self, run_id: str, verb: str):
        """The run's status, or ``None`` if the driver has no such run."""
        request = pb.GetRunRequest(run_id=run_id)
        try:
            return self._read("GetRun", request, f"{verb} run {run_id}: read its current generation")
        except NotFound:
            return None
        except InvalidArgument as e:
            field = f"shape.{e.field}" if e.field else None
            raise InvalidShape(e.status_code, e.message, field) from None

    def _choose_generation(self, msg, verb: str) -> int | None:
        """Sets ``msg.generation`` when the shape names none, as provisionctl
        does: 1 for a new run; the run's own generation when the content is
        what the driver has (so that applying it again changes nothing);
        otherwise the next one. Returns the generation to try if the driver
        says the content differs after all (a secret value changed, which
        cannot be compared here), else ``None``."""
        if msg.generation != 0:
            return None
        current = self._current(msg.run_id, verb)
        if current is None:
            msg.generation = 1
            return None
        if current.HasField("shape") and same_content(current.shape, msg):
            msg.generation = current.generation
            return current.generation + 1
        msg.generation = current.generation + 1
        return None

    # -- the API -------------------------------------------------------------

    def apply(self, shape: Mapping | Any):
        """Creates the run or moves it to ``shape``; returns the ``ApplyResponse``
        (``run_uid``, ``generation``, ``changed``, ``created``).

        ``shape`` is a mapping in the shape-file format (or a ``ClusterShape``
        message). Without a ``generation``, the driver's current generation + 1
        is used (1 for a new run), or the current one when the content is
        unchanged, so that applying the same shape again is a no-op
        (``changed`` false). Raises :class:`InvalidShape` (nothing changed),
        :class:`Conflict` (e.g. the run changed meanwhile, or is being deleted)
        or :class:`OutcomeUnknown` (check with :meth:`get`).
        """
        msg = self._shape_message(shape)
        secrets = secret_values(msg)
        fallback = self._choose_generation(msg, "apply")
        try:
            return self._apply_once(msg, secrets)
        except Conflict:
            if fallback is None:
                raise
            msg.generation = fallback
            return self._apply_once(msg, secrets)

    def _apply_once(self, msg, secrets: list[str]):
        doing = f"apply run {msg.run_id} at generation {msg.generation}"
        return self._change("Apply", pb.ApplyRequest(shape=msg), doing, msg.run_id, secrets=secrets)

    def apply_file(self, path: str | os.PathLike):
        """:meth:`apply` of the shape in a YAML or JSON file (provisionctl's format)."""
        return self.apply(load_shape_file(path))

    def plan(self, shape: Mapping | Any):
        """What applying ``shape`` would do, recording nothing: the
        ``PlanResponse`` (decisions per node, slots scaled down, secrets that
        change, rollout waves). The generation is chosen as :meth:`apply`
        chooses it."""
        msg = self._shape_message(shape)
        secrets = secret_values(msg)
        fallback = self._choose_generation(msg, "plan")
        doing = f"plan run {msg.run_id}"
        try:
            return self._read("Plan", pb.PlanRequest(shape=msg), doing, shape_secrets=secrets)
        except Conflict:
            if fallback is None:
                raise
            msg.generation = fallback
            return self._read("Plan", pb.PlanRequest(shape=msg), doing, shape_secrets=secrets)

    def plan_file(self, path: str | os.PathLike):
        """:meth:`plan` of the shape in a YAML or JSON file."""
        return self.plan(load_shape_file(path))

    def get(self, run_id: str, nodes: bool = False):
        """The run's ``RunStatus`` (with every node's state when ``nodes``).
        Its shape's secret values read ``<redacted>``. Raises :class:`NotFound`."""
        return self._read("GetRun", pb.GetRunRequest(run_id=run_id, include_nodes=nodes), f"get run {run_id}")

    def nodes(self, run_id: str, page_size: int = 0):
        """Every node of the run (``NodeStatus``), slot by slot in node id
        order, read a page at a time with ``ListNodes`` (at most
        ``page_size`` slots a page; 0: the driver's default). :meth:`get`
        with ``nodes`` sends them in one message, which a run of more than
        some tens of thousands of nodes does not fit. Raises
        :class:`NotFound`."""
        token = ""
        while True:
            request = pb.ListNodesRequest(run_id=run_id, page_size=page_size, page_token=token)
            page = self._read("ListNodes", request, f"list the nodes of run {run_id}")
            yield from page.nodes
            if not page.next_page_token:
                return
            token = page.next_page_token

    def list(self, label_selector: str = "") -> list:
        """Every run's ``RunStatus`` the caller may see; with
        ``label_selector`` (``team=ml,env!=dev,gpu,!legacy``: all must hold),
        only the runs whose labels match."""
        request = pb.ListRunsRequest()
        if label_selector:
            if "label_selector" not in pb.ListRunsRequest.DESCRIPTOR.fields_by_name:
                raise ValueError("this client's proto has no ListRunsRequest.label_selector")
            request.label_selector = label_selector
        return list(self._read("ListRuns", request, "list runs").runs)

    def explain(self, run_id: str, node_id: str):
        """Why a node (``GROUP-INDEX``) is where it is: the ``NodeExplanation``."""
        request = pb.ExplainNodeRequest(run_id=run_id, node_id=node_id)
        return self._read("ExplainNode", request, f"explain node {node_id} of run {run_id}")

    def events(self, run_id: str, after_seq: int = 0, limit: int = 0):
        """The run's event log, oldest first: the ``ListEventsResponse`` with
        the events after ``after_seq`` (at most ``limit``; 0: all kept)."""
        request = pb.ListEventsRequest(run_id=run_id, after_seq=after_seq, limit=limit)
        return self._read("ListEvents", request, f"list the events of run {run_id}")

    def providers(self):
        """The providers the driver's executor serves: the
        ``ListProvidersResponse`` (``known`` is false until the executor has
        said, and an apply is then not checked against the list)."""
        return self._read("ListProviders", pb.ListProvidersRequest(), "list providers")

    def delete(self, run_id: str, ignore_not_found: bool = False):
        """Starts deleting the run; returns its ``RunStatus``. The run is gone
        once its nodes are cleaned up (a :meth:`watch` ends then). With
        ``ignore_not_found``, a run that does not exist returns ``None``."""
        try:
            return self._change("DeleteRun", pb.DeleteRunRequest(run_id=run_id), f"delete run {run_id}", run_id)
        except NotFound:
            if ignore_not_found:
                return None
            raise

    def pause(self, run_id: str):
        """Pauses the run (nothing new is dispatched); returns its ``RunStatus``."""
        return self._change("PauseRun", pb.PauseRunRequest(run_id=run_id), f"pause run {run_id}", run_id)

    def resume(self, run_id: str):
        """Resumes a paused run; returns its ``RunStatus``."""
        return self._change("ResumeRun", pb.ResumeRunRequest(run_id=run_id), f"resume run {run_id}", run_id)

    def promote(self, run_id: str, group_id: str):
        """Lets a group's rollout go on past its canary; returns the ``RunStatus``."""
        request = pb.PromoteRolloutRequest(run_id=run_id, group_id=group_id)
        doing = f"promote the rollout of group {group_id} of run {run_id}"
        return self._change("PromoteRollout", request, doing, run_id)

    def watch(self, run_id: str, nodes: bool = False, timeout: float | None = None) -> Iterator:
        """The run's ``RunStatus`` now, then at every change, until the run is
        deleted (the last status has phase ``RUN_PHASE_DELETED``).

        A broken stream (a driver restart) is opened again with backoff, up
        to ``retries`` times in a row; a run that is gone by then ends the
        iteration. ``timeout`` (seconds) bounds the whole watch: past it,
        :class:`Timeout` is raised. Errors are raised while iterating. Closing
        the iterator (or leaving a ``for`` loop) ends the stream.
        """
        request = pb.WatchRunRequest(run_id=run_id, include_nodes=nodes)
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._watch(request, f"watch run {run_id}", deadline, timeout)

    def _watch(self, request, doing: str, deadline: float | None, timeout: float | None) -> Iterator:
        failures = 0
        seen = False

        def timed_out() -> Timeout:
            return Timeout(grpc.StatusCode.DEADLINE_EXCEEDED, f"{doing}: gave up after {timeout} s")

        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise timed_out()
            stream = self._calls["WatchRun"](request, timeout=remaining, metadata=self._metadata)
            try:
                for status in stream:
                    seen = True
                    failures = 0
                    yield status
                    if status.phase == pb.RUN_PHASE_DELETED:
                        return
                # The server ended the stream without the run being deleted:
                # open it again, as after a broken one.
                error: grpc.RpcError | None = None
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None:
                    if time.monotonic() >= deadline - 0.05:
                        raise timed_out() from None
                if err.code() == grpc.StatusCode.NOT_FOUND and seen:
                    return  # gone between two streams: deleted and cleaned up
                error = err
            finally:
                stream.cancel()
            if error is None:
                delay = (
                    None
                    if failures >= self.retries
                    else min(_BACKOFF_CAP, _BACKOFF_BASE * 2**failures) * random.uniform(0.5, 1.0)
                )
            else:
                delay = self._retry_delay(error, failures)
            if delay is None or (deadline is not None and time.monotonic() + delay >= deadline):
                if error is not None:
                    raise from_rpc_error(error, doing) from None
                raise Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{doing}: the server ended the watch before the run was deleted, and it could not be "
                    "opened again",
                )
            failures += 1
            time.sleep(delay)

    def wait(self, run_id: str, timeout: float | None = 300.0, generation: int | None = None):
        """Waits until the run converges (at ``generation`` or later, when
        given) and returns that ``RunStatus``.

        Raises :class:`Timeout` after ``timeout`` seconds (``None``: no limit),
        :class:`Stalled` when the run is stalled (nothing more happens without
        a change to its shape), :class:`NotFound` if the run does not exist or
        is deleted meanwhile.
        """
        last = None
        try:
            for status in self.watch(run_id, timeout=timeout):
                last = status
                if status.phase == pb.RUN_PHASE_DELETED:
                    raise NotFound(grpc.StatusCode.NOT_FOUND, f"wait for run {run_id}: the run was deleted")
                current = generation is None or status.generation >= generation
                if current and status.converged:
                    return status
                stalled = _condition(status, "Stalled")
                if current and stalled is not None and stalled.status:
                    raise Stalled(f"run {run_id} is stalled: {stalled.message}", status)
        except Timeout:
            if last is None:
                raise
            desired = sum(g.desired for g in last.groups)
            raise Timeout(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"run {run_id} did not converge within {timeout} s: {last.ready_count}/{desired} nodes "
                f"ready at generation {last.generation}, phase {pb.RunPhase.Name(last.phase)}",
            ) from None
        raise NotFound(grpc.StatusCode.NOT_FOUND, f"wait for run {run_id}: the run is gone")
