#!/usr/bin/env python3
"""An example provider plugin, in Python, for the provider protocol version 1.

The protocol (and its contract, in the comments) is
``proto/provisioning/provider/v1/provider.proto``. This plugin serves the
provider name ``python-example``. Its "resources" are local stand-ins for
machines: each one is a TCP listener on 127.0.0.1 that accepts connections and
closes them, so that an executor's TCP health probe has something real to
connect to. Bootstrap sessions walk through the stages on a timer.

What it shows a provider author:

* the identity as the idempotency key: CreateLease and StartBootstrap adopt
  what the identity already holds, CancelBootstrap and DestroyLease of
  something absent succeed;
* the four outcomes, and ``Ambiguous`` whenever the plugin is unsure (a call
  past its deadline, an unexpected exception);
* persistence, so a restarted plugin lists everything it answered
  ``Succeeded`` for (``--state-file``);
* the Watch stream: a replay of the current state when a stream opens, then
  live events;
* the ``ProviderTesting`` hooks for conformance runs (``--testing``).

Run ``python3 provider.py --help`` for the command line. Once it listens, it
writes ``provider-listening <address>`` on standard output; logs go to
standard error.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import grpc

import protos

pb, pb_grpc = protos.load()

log = logging.getLogger("python-provider")

PROVIDER_NAMES = ["python-example"]

#: The stages of a successful bootstrap, in order.
STAGES = [
    pb.STAGE_CONNECTED,
    pb.STAGE_BOOT_CHECK,
    pb.STAGE_AGENT_STARTED,
    pb.STAGE_JOINED,
    pb.STAGE_CONVERGED,
]

#: The stage reported instead of each stage when the bootstrap fails there.
FAILURE_OF = {
    pb.STAGE_CONNECTED: pb.STAGE_FAILED_CONNECT,
    pb.STAGE_BOOT_CHECK: pb.STAGE_FAILED_BOOT_CHECK,
    pb.STAGE_AGENT_STARTED: pb.STAGE_FAILED_AGENT_START,
    pb.STAGE_JOINED: pb.STAGE_FAILED_JOIN,
}

#: Events a Watch stream may have queued beyond two a resource before it
#: counts as stuck and is cancelled (the executor opens a new one and gets
#: the latest state again).
WATCH_BUFFER = 16 * 1024
# The most one page of ListResourcePages holds, encoded.
PAGE_BYTES = 1 << 20


def varint_len(n: int) -> int:
    """The bytes of `n` as a protobuf varint."""
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


#: Stages after which a session reports nothing more.
TERMINAL_STAGES = {pb.STAGE_CONVERGED, *FAILURE_OF.values(), pb.STAGE_FAILED_CLOSED}


def now_ms() -> int:
    """Milliseconds since the Unix epoch."""
    return int(time.time() * 1000)


# ---------------------------------------------------------------------------
# Answers


def succeeded() -> "pb.Answer":
    return pb.Answer(succeeded=pb.Succeeded())


def not_ready(reason: str) -> "pb.Answer":
    return pb.Answer(not_ready=pb.NotReady(reason=reason))


def failed(reason: str, permanent: bool) -> "pb.Answer":
    kind = pb.FAILURE_KIND_PERMANENT if permanent else pb.FAILURE_KIND_RETRYABLE
    return pb.Answer(failed=pb.Failed(kind=kind, reason=reason))


def ambiguous(reason: str) -> "pb.Answer":
    return pb.Answer(ambiguous=pb.Ambiguous(reason=reason))


def answers(response_type: type) -> Callable:
    """Wraps a handler of a call that carries a ``Call``.

    A call that arrives after its ``deadline_unix_ms`` is answered
    ``Ambiguous`` without doing anything: the executor has stopped waiting and
    reads any answer as ambiguous anyway, and its next call for the identity
    finds the truth. An unexpected exception is logged and answered
    ``Ambiguous`` too: the handler may have changed something before it
    raised, so a definite ``Failed`` would be a promise the plugin cannot keep.
    """

    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)
        def guarded(self, request, context):
            deadline = request.call.deadline_unix_ms
            if deadline and now_ms() > deadline:
                log.warning("%s %s: arrived past its deadline", handler.__name__, request.call.operation_id)
                return response_type(answer=ambiguous("the call arrived after its deadline"))
            try:
                return handler(self, request, context)
            except Exception as err:  # noqa: BLE001 - every error becomes Ambiguous
                log.exception("%s %s failed unexpectedly", handler.__name__, request.call.operation_id)
                return response_type(answer=ambiguous(f"unexpected error in the plugin: {err!r}"))

        return guarded

    return wrap


# ---------------------------------------------------------------------------
# Identities and resources

#: An identity as a hashable key: (run_uid, run_id, node_id, attempt).
Key = tuple[str, str, str, int]


def key_of(identity: "pb.Identity") -> Key:
    return (identity.run_uid, identity.run_id, identity.node_id, identity.attempt)


def identity_of(key: Key) -> "pb.Identity":
    run_uid, run_id, node_id, attempt = key
    return pb.Identity(run_uid=run_uid, run_id=run_id, node_id=node_id, attempt=attempt)


def describe(key: Key) -> str:
    """A short form of an identity for logs."""
    return "{}/{}/{}#{}".format(*key)


def invalid_identity(call: "pb.Call") -> Optional[str]:
    """Names what is missing from the call's identity, or returns None."""
    if not call.HasField("identity"):
        return "call.identity is missing"
    for name in ("run_uid", "run_id", "node_id"):
        if not getattr(call.identity, name):
            return f"call.identity.{name} is empty"
    return None


class Endpoint:
    """A TCP listener on 127.0.0.1 that accepts connections and closes them.

    It stands in for the node's endpoint: a connect succeeds while it is
    open and is refused once it is closed.
    """

    def __init__(self, port: int = 0):
        """Listens on ``port``, or on a port the OS picks when it is 0 (or taken)."""
        try:
            self._sock = socket.create_server(("127.0.0.1", port))
        except OSError:
            if port == 0:
                raise
            log.info("port %d is taken; listening on a new one", port)
            self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        # A socket pair wakes the accepting thread when the endpoint closes.
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._accept, name=f"endpoint-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            ready, _, _ = select.select([self._sock, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            try:
                conn, _ = self._sock.accept()
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stops listening; returns once new connections are refused."""
        self._wake_w.send(b"x")
        self._thread.join()
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()


@dataclass
class Resource:
    """One resource the plugin holds, and its bootstrap session if any."""

    key: Key
    lease_id: str
    provider_name: str
    port: int
    #: The endpoint is bound once a lookup has answered NotReady (see LookupEndpoint).
    bound: bool = False
    healthy: bool = True
    #: The live bootstrap session's id; empty when there is none.
    session_id: str = ""
    stage: int = pb.STAGE_UNSPECIFIED
    stage_at_ms: int = 0
    #: The stage where the session is asked to fail (boot parameter `fail_at`).
    fail_at: int = pb.STAGE_UNSPECIFIED
    #: Not persisted: the open listener (None while unhealthy).
    listener: Optional[Endpoint] = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def open_listener(self) -> None:
        """Opens the endpoint listener, on the same port when it is free."""
        if self.listener is None:
            self.listener = Endpoint(self.port)
            self.port = self.listener.port

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def to_json(self) -> dict:
        run_uid, run_id, node_id, attempt = self.key
        return {
            "identity": {"run_uid": run_uid, "run_id": run_id, "node_id": node_id, "attempt": attempt},
            "lease_id": self.lease_id,
            "provider_name": self.provider_name,
            "port": self.port,
            "bound": self.bound,
            "healthy": self.healthy,
            "session_id": self.session_id,
            "stage": pb.Stage.Name(self.stage),
            "stage_at_ms": self.stage_at_ms,
            "fail_at": pb.Stage.Name(self.fail_at),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Resource":
        ident = data["identity"]
        return cls(
            key=(ident["run_uid"], ident["run_id"], ident["node_id"], int(ident["attempt"])),
            lease_id=data["lease_id"],
            provider_name=data["provider_name"],
            port=int(data["port"]),
            bound=bool(data["bound"]),
            healthy=bool(data["healthy"]),
            session_id=data["session_id"],
            stage=pb.Stage.Value(data["stage"]),
            stage_at_ms=int(data["stage_at_ms"]),
            fail_at=pb.Stage.Value(data["fail_at"]),
        )


def parse_fail_at(boot) -> int:
    """The stage named by the boot parameter ``fail_at``, or STAGE_UNSPECIFIED.

    Accepts ``joined``, ``JOINED`` or ``STAGE_JOINED``; raises ValueError for
    a name that is not a stage that can fail.
    """
    if "fail_at" not in boot:
        return pb.STAGE_UNSPECIFIED
    name = boot["fail_at"].value.strip().upper()
    if not name.startswith("STAGE_"):
        name = "STAGE_" + name
    stage = pb.Stage.Value(name) if name in pb.Stage.keys() else None
    if stage not in FAILURE_OF:
        choices = ", ".join(pb.Stage.Name(s)[len("STAGE_"):].lower() for s in FAILURE_OF)
        raise ValueError(f"boot parameter fail_at must be one of {choices}")
    return stage


# ---------------------------------------------------------------------------
# The plugin's state


class State:
    """Every resource the plugin holds, the open Watch streams, and the state file.

    One lock guards everything; every change is persisted (when there is a
    state file) and broadcast while the lock is held, so a Watch stream that
    opens sees either the state before a change and then its event, or the
    state after it.
    """

    def __init__(self, state_file: Optional[Path], stage_interval_s: float):
        self._lock = threading.RLock()
        self._resources: dict[Key, Resource] = {}
        #: The open Watch streams: each one's queue, and its gRPC context.
        self._watchers: dict[queue.Queue, grpc.ServicerContext] = {}
        self._state_file = state_file
        self._stage_interval_s = stage_interval_s
        self.stopping = threading.Event()

    # -- persistence ------------------------------------------------------

    def load(self) -> None:
        """Reads the state file, re-opens listeners and resumes sessions."""
        if self._state_file is None or not self._state_file.exists():
            return
        data = json.loads(self._state_file.read_text())
        with self._lock:
            for item in data["resources"]:
                res = Resource.from_json(item)
                self._resources[res.key] = res
                if res.healthy:
                    res.open_listener()  # may move to a new port
                if res.session_id and res.stage not in TERMINAL_STAGES:
                    self._start_session_thread(res)
            self._persist()  # ports may have moved
        log.info("loaded %d resources from %s", len(self._resources), self._state_file)

    def _persist(self) -> None:
        """Writes every resource to the state file: a temporary file, then a rename."""
        if self._state_file is None:
            return
        data = {"version": 1, "resources": [r.to_json() for r in self._resources.values()]}
        directory = self._state_file.parent
        fd, tmp = tempfile.mkstemp(prefix=self._state_file.name + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(data, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self._state_file)
        except BaseException:
            os.unlink(tmp)
            raise

    # -- Watch ------------------------------------------------------------

    def _broadcast(self, event: "pb.WatchEvent") -> None:
        # A new stream's queue starts with two events a resource (its stage
        # and its health), so the bound grows with what is held: a fixed one
        # would cancel every stream of a plugin holding more than it, each
        # one at its first event after the snapshot.
        bound = WATCH_BUFFER + 2 * len(self._resources)
        for watcher, context in list(self._watchers.items()):
            if watcher.qsize() >= bound:
                # A reader this far behind is dropped rather than buffered
                # without bound; nothing is lost for good, since the stream
                # it opens next starts with the latest state.
                log.warning("a Watch stream fell behind: cancelling it")
                del self._watchers[watcher]
                context.cancel()
                continue
            watcher.put(event)

    def subscribe(self, context: grpc.ServicerContext) -> queue.Queue:
        """Opens a Watch: a queue holding the current state, then every new event."""
        watcher: queue.Queue = queue.Queue()
        with self._lock:
            for res in self._resources.values():
                if res.session_id and res.stage != pb.STAGE_UNSPECIFIED:
                    watcher.put(self._stage_event(res))
            for res in self._resources.values():
                watcher.put(self._health_event(res, "current health"))
            self._watchers[watcher] = context
        return watcher

    def unsubscribe(self, watcher: queue.Queue) -> None:
        with self._lock:
            self._watchers.pop(watcher, None)

    @staticmethod
    def _stage_event(res: Resource) -> "pb.WatchEvent":
        return pb.WatchEvent(
            stage=pb.StageReached(
                identity=identity_of(res.key),
                session_id=res.session_id,
                stage=res.stage,
                at_unix_ms=res.stage_at_ms,
            )
        )

    @staticmethod
    def _health_event(res: Resource, detail: str) -> "pb.WatchEvent":
        return pb.WatchEvent(
            health=pb.HealthChanged(
                identity=identity_of(res.key), healthy=res.healthy, detail=detail, at_unix_ms=now_ms()
            )
        )

    # -- resources --------------------------------------------------------

    def get(self, key: Key) -> Optional[Resource]:
        with self._lock:
            return self._resources.get(key)

    def resources(self) -> list[Resource]:
        with self._lock:
            return list(self._resources.values())

    def create(self, key: Key, provider_name: str) -> tuple[Resource, bool]:
        """The identity's resource, made when it holds none; True when made."""
        with self._lock:
            existing = self._resources.get(key)
            if existing is not None:
                return existing, False
            res = Resource(key=key, lease_id=f"py-{uuid.uuid4().hex}", provider_name=provider_name, port=0)
            res.open_listener()
            self._resources[key] = res
            try:
                self._persist()
            except BaseException:
                # Not persisted: undo, so the caller's Ambiguous leaves nothing behind.
                del self._resources[key]
                res.close_listener()
                raise
            return res, True

    def bind(self, res: Resource) -> None:
        """Marks the resource's endpoint bound (LookupEndpoint answers it from now on)."""
        with self._lock:
            res.bound = True
            self._persist()

    def remove(self, key: Key, lost_reason: Optional[str] = None) -> bool:
        """Drops the identity's resource (and its session); False when absent.

        With ``lost_reason``, the removal is a loss and is reported as `Lost`.
        """
        with self._lock:
            res = self._resources.pop(key, None)
            if res is None:
                return False
            try:
                self._persist()
            except BaseException:
                self._resources[key] = res  # still held, as the state file says
                raise
            res.close_listener()
            if lost_reason is not None:
                self._broadcast(
                    pb.WatchEvent(lost=pb.Lost(identity=identity_of(key), reason=lost_reason, at_unix_ms=now_ms()))
                )
            return True

    def set_healthy(self, key: Key, healthy: bool) -> bool:
        """Opens or closes the identity's endpoint and reports its health; False when absent."""
        with self._lock:
            res = self._resources.get(key)
            if res is None:
                return False
            res.healthy = healthy
            if healthy:
                res.open_listener()
            else:
                res.close_listener()
            self._persist()
            self._broadcast(self._health_event(res, "set through ProviderTesting.SetHealthy"))
            return True

    # -- bootstrap sessions -----------------------------------------------

    def start_session(self, res: Resource, fail_at: int) -> str:
        """Starts a session on the resource (or adopts its live one); its id."""
        with self._lock:
            if res.session_id:
                return res.session_id
            res.session_id = f"py-s-{uuid.uuid4().hex}"
            res.stage, res.stage_at_ms, res.fail_at = pb.STAGE_UNSPECIFIED, 0, fail_at
            self._persist()
            self._start_session_thread(res)
            return res.session_id

    def cancel_session(self, key: Key, session_id: str) -> None:
        """Ends the identity's session (only the one named, when a name is given)."""
        with self._lock:
            res = self._resources.get(key)
            if res is None or not res.session_id:
                return
            if session_id and session_id != res.session_id:
                log.info("cancel of %s: session %s is not live (absent is success)", describe(key), session_id)
                return
            res.session_id, res.stage, res.stage_at_ms, res.fail_at = "", pb.STAGE_UNSPECIFIED, 0, pb.STAGE_UNSPECIFIED
            self._persist()

    def _start_session_thread(self, res: Resource) -> None:
        thread = threading.Thread(
            target=self._run_session,
            args=(res.key, res.session_id),
            name=f"session-{res.session_id}",
            daemon=True,
        )
        thread.start()

    def _run_session(self, key: Key, session_id: str) -> None:
        """Walks a session through its stages, one per interval, from where it is."""
        while not self.stopping.wait(self._stage_interval_s):
            with self._lock:
                res = self._resources.get(key)
                if res is None or res.session_id != session_id:
                    return  # cancelled, destroyed or lost
                following = STAGES.index(res.stage) + 1 if res.stage in STAGES else 0
                stage = STAGES[following]
                if stage == res.fail_at:
                    stage = FAILURE_OF[stage]
                res.stage, res.stage_at_ms = stage, now_ms()
                self._persist()
                self._broadcast(self._stage_event(res))
                log.info("%s: session %s reached %s", describe(key), session_id, pb.Stage.Name(stage))
                if stage in TERMINAL_STAGES:
                    return

    def close(self) -> None:
        """Stops the sessions and closes every listener (the state file stays)."""
        self.stopping.set()
        with self._lock:
            for res in self._resources.values():
                res.close_listener()


# ---------------------------------------------------------------------------
# The services


class ProviderService(pb_grpc.ProviderServicer):
    """The `Provider` service over a :class:`State`."""

    def __init__(self, state: State):
        self._state = state

    def GetInfo(self, request, context):
        return pb.GetInfoResponse(
            protocol_version=pb.PROTOCOL_VERSION_1,
            provider_names=PROVIDER_NAMES,
            capabilities=pb.Capabilities(reports_health=True, reports_loss=True),
            description="python-example: the example provider plugin in Python (local TCP listeners as resources)",
        )

    @answers(pb.CreateLeaseResponse)
    def CreateLease(self, request, context):
        call = request.call
        problem = invalid_identity(call)
        if problem:
            return pb.CreateLeaseResponse(answer=failed(problem, permanent=True))
        provider_name = call.provider_name or PROVIDER_NAMES[0]
        if provider_name not in PROVIDER_NAMES:
            return pb.CreateLeaseResponse(
                answer=failed(f"provider name {provider_name!r} is not served by this plugin", permanent=True)
            )
        key = key_of(call.identity)
        # Adopt first: a retry must never make a second resource, and must
        # not fail on an input that succeeded before.
        existing = self._state.get(key)
        if existing is not None:
            log.info("create %s: adopted lease %s", describe(key), existing.lease_id)
            return pb.CreateLeaseResponse(answer=succeeded(), lease_id=existing.lease_id)
        if not request.HasField("template"):
            return pb.CreateLeaseResponse(answer=failed("template is missing", permanent=True))
        if not request.template.image:
            return pb.CreateLeaseResponse(answer=failed("template.image is empty", permanent=True))
        if request.template.image.startswith("bad:"):
            # The documented way to exercise a permanent failure: nothing is made.
            return pb.CreateLeaseResponse(
                answer=failed(f"unknown image {request.template.image!r}", permanent=True)
            )
        res, made = self._state.create(key, provider_name)
        log.info("create %s: %s lease %s on %s", describe(key), "made" if made else "adopted", res.lease_id, res.endpoint)
        return pb.CreateLeaseResponse(answer=succeeded(), lease_id=res.lease_id)

    @answers(pb.LookupEndpointResponse)
    def LookupEndpoint(self, request, context):
        call = request.call
        problem = invalid_identity(call)
        if problem:
            return pb.LookupEndpointResponse(answer=failed(problem, permanent=True))
        key = key_of(call.identity)
        if not request.lease_id:
            return pb.LookupEndpointResponse(answer=failed("lease_id is empty", permanent=True))
        res = self._state.get(key)
        if res is None:
            return pb.LookupEndpointResponse(answer=failed("the identity holds no resource", permanent=True))
        if request.lease_id != res.lease_id:
            return pb.LookupEndpointResponse(
                answer=failed(f"lease {request.lease_id} is not the identity's lease", permanent=True)
            )
        if not res.bound:
            # A real provider answers NotReady until the machine has an
            # address; here the first lookup plays that part.
            self._state.bind(res)
            return pb.LookupEndpointResponse(answer=not_ready("the endpoint is being bound"))
        return pb.LookupEndpointResponse(answer=succeeded(), endpoint=res.endpoint)

    @answers(pb.StartBootstrapResponse)
    def StartBootstrap(self, request, context):
        call = request.call
        problem = invalid_identity(call)
        if problem:
            return pb.StartBootstrapResponse(answer=failed(problem, permanent=True))
        key = key_of(call.identity)
        if not request.lease_id:
            return pb.StartBootstrapResponse(answer=failed("lease_id is empty", permanent=True))
        res = self._state.get(key)
        if res is None:
            return pb.StartBootstrapResponse(answer=failed("no lease: the identity holds no resource", permanent=False))
        if request.lease_id != res.lease_id:
            return pb.StartBootstrapResponse(
                answer=failed(f"lease {request.lease_id} is not the identity's lease", permanent=True)
            )
        if res.session_id:
            log.info("bootstrap %s: adopted session %s", describe(key), res.session_id)
            return pb.StartBootstrapResponse(answer=succeeded(), session_id=res.session_id)
        try:
            fail_at = parse_fail_at(request.boot)
        except ValueError as err:
            return pb.StartBootstrapResponse(answer=failed(str(err), permanent=True))
        session_id = self._state.start_session(res, fail_at)
        log.info("bootstrap %s: session %s", describe(key), session_id)
        return pb.StartBootstrapResponse(answer=succeeded(), session_id=session_id)

    @answers(pb.CancelBootstrapResponse)
    def CancelBootstrap(self, request, context):
        call = request.call
        problem = invalid_identity(call)
        if problem:
            return pb.CancelBootstrapResponse(answer=failed(problem, permanent=True))
        self._state.cancel_session(key_of(call.identity), request.session_id)
        return pb.CancelBootstrapResponse(answer=succeeded())

    @answers(pb.DestroyLeaseResponse)
    def DestroyLease(self, request, context):
        call = request.call
        problem = invalid_identity(call)
        if problem:
            return pb.DestroyLeaseResponse(answer=failed(problem, permanent=True))
        key = key_of(call.identity)
        res = self._state.get(key)
        if res is not None and request.lease_id and request.lease_id != res.lease_id:
            # The lease named is not held (absent is success); the identity's
            # other resource is left alone, and ListResources shows it.
            log.warning("destroy %s: lease %s is not held (it holds %s)", describe(key), request.lease_id, res.lease_id)
            return pb.DestroyLeaseResponse(answer=succeeded())
        removed = self._state.remove(key)
        log.info("destroy %s: %s", describe(key), "destroyed" if removed else "absent")
        return pb.DestroyLeaseResponse(answer=succeeded())

    def _listed(self) -> list["pb.Resource"]:
        return [
            pb.Resource(
                identity=identity_of(res.key),
                lease_id=res.lease_id,
                endpoint=res.endpoint if res.bound else "",
                session_live=bool(res.session_id),
                provider_name=res.provider_name,
            )
            for res in self._state.resources()
        ]

    def ListResources(self, request, context):
        return pb.ListResourcesResponse(resources=self._listed())

    def ListResourcePages(self, request, context) -> Iterator["pb.ListResourcesResponse"]:
        # One read, in pages of at most PAGE_BYTES encoded, the last marked.
        page: list["pb.Resource"] = []
        size = 0
        for resource in self._listed():
            n = resource.ByteSize()
            entry = 1 + varint_len(n) + n
            if page and size + entry > PAGE_BYTES:
                yield pb.ListResourcesResponse(resources=page)
                page, size = [], 0
            page.append(resource)
            size += entry
        yield pb.ListResourcesResponse(resources=page, last=True)

    def Watch(self, request, context) -> Iterator["pb.WatchEvent"]:
        watcher = self._state.subscribe(context)
        # When the stream ends (client gone, cancelled, server stopping), wake
        # the loop below so this worker thread is released at once.
        context.add_callback(lambda: watcher.put(None))
        try:
            while context.is_active():
                event = watcher.get()
                if event is None:
                    return
                yield event
        finally:
            self._state.unsubscribe(watcher)


class ProviderTestingService(pb_grpc.ProviderTestingServicer):
    """The `ProviderTesting` hooks, served only with ``--testing``."""

    def __init__(self, state: State):
        self._state = state

    def Lose(self, request, context):
        key = key_of(request.identity)
        found = self._state.remove(key, lost_reason="lost through ProviderTesting.Lose")
        log.info("lose %s: %s", describe(key), "lost" if found else "not held")
        return pb.LoseResponse(found=found)

    def SetHealthy(self, request, context):
        key = key_of(request.identity)
        found = self._state.set_healthy(key, request.healthy)
        log.info("set healthy %s = %s: %s", describe(key), request.healthy, "done" if found else "not held")
        return pb.SetHealthyResponse(found=found)


# ---------------------------------------------------------------------------
# Main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="host:port (port 0: chosen by the OS) or unix:/path/to/socket (default %(default)s)",
    )
    parser.add_argument("--state-file", type=Path, help="persist resources to this JSON file (default: memory only)")
    parser.add_argument("--testing", action="store_true", help="also serve the ProviderTesting hooks")
    parser.add_argument(
        "--stage-interval-ms", type=int, default=20, help="time between bootstrap stages (default %(default)s)"
    )
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="python-provider %(levelname)s %(message)s")

    state = State(args.state_file, args.stage_interval_ms / 1000)
    state.load()

    # Each open Watch stream holds a worker thread for as long as it is open.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="grpc"))
    pb_grpc.add_ProviderServicer_to_server(ProviderService(state), server)
    if args.testing:
        pb_grpc.add_ProviderTestingServicer_to_server(ProviderTestingService(state), server)

    port = server.add_insecure_port(args.listen)
    if args.listen.startswith("unix:"):
        address = args.listen
    else:
        host = args.listen.rsplit(":", 1)[0]
        address = f"{host}:{port}"
    server.start()

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    # The announcement: the one line on standard output, once listening.
    print(f"provider-listening {address}", flush=True)
    log.info("listening on %s (testing hooks %s)", address, "on" if args.testing else "off")

    # A wait with a timeout: the kernel may hand SIGTERM to one of gRPC's
    # threads, and then the handler runs only when this thread next runs
    # Python; an untimed wait would sleep through it.
    while not stop.wait(timeout=0.2):
        pass
    log.info("stopping")
    server.stop(grace=1).wait(timeout=5)
    state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
