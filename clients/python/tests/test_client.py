"""Tests of the Python client: unit tests of the shape conversion, the error
mapping and the environment settings, and tests against the real services.

The service tests start ``decider-svc``, ``executor-svc`` (fake backend) and
``driver-svc`` as separate processes on 127.0.0.1, from
``PROVISIONING_BIN_DIR`` (default: ``target/debug`` of the repository), each
on port 0 with ``--ready-file`` announcing the bound address. Each test class
that needs them starts its own set and stops exactly those processes, by
their handles, when it ends (also when it fails). A failed test prints the
services' logs.

Run from the repository root::

    python3 -m unittest discover -s clients/python/tests -v
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

import grpc
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# The package under test is the one beside the tests, installed or not.
sys.path.insert(0, str(HERE.parent))

import provisioning_client as pc  # noqa: E402
from provisioning_client import (  # noqa: E402
    Client,
    Conflict,
    InvalidArgument,
    InvalidShape,
    NotFound,
    OutcomeUnknown,
    PermissionDenied,
    ProvisioningError,
    ResourceExhausted,
    Stalled,
    Timeout,
    TlsConfig,
    Unauthenticated,
    Unavailable,
    pb,
)
from provisioning_client import errors as errs  # noqa: E402
from provisioning_client.shape import (  # noqa: E402
    HAS_LABELS,
    load_shape_file,
    parse_duration_ms,
    parse_shape_text,
    same_content,
    shape_to_proto,
)

BIN_DIR = Path(os.environ.get("PROVISIONING_BIN_DIR") or REPO / "target" / "debug")
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
SECRET = "s3cret-join-token-7f2c"


def binary(name: str) -> Path:
    path = BIN_DIR / name
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: build the services (cargo build --bins) or set PROVISIONING_BIN_DIR"
        )
    return path


# ---------------------------------------------------------------------------
# The services
# ---------------------------------------------------------------------------

# Every service process still running, so that one left over by an
# interrupted run is stopped when the interpreter exits.
_RUNNING: set[Service] = set()


class Service:
    """One service process, started with ``--listen 127.0.0.1:0 --ready-file
    F`` and ``transport`` (``--insecure``, or its TLS flags), its stderr (and
    stdout) in ``<workdir>/<name>.log``."""

    def __init__(self, name: str, program: str, args: list[str], workdir: Path, transport: list[str]):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        ready = workdir / f"{name}.ready"
        self._log = open(self.log_path, "wb")
        command = [
            str(binary(program)),
            "--listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            *transport,
            *args,
        ]
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        _RUNNING.add(self)
        self.address = self._await_ready(ready)

    def _await_ready(self, ready: Path) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if ready.is_file():
                text = ready.read_text().strip()
                if text:
                    return text
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            time.sleep(0.02)
        raise RuntimeError(f"{self.name} was not ready within {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Ends this process: SIGTERM, then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()
        _RUNNING.discard(self)


@atexit.register
def _stop_leftovers() -> None:
    for service in list(_RUNNING):
        service.stop()


class Stack:
    """A decider, an executor with the fake backend, and a driver wired to
    them: in plaintext, or over TLS with the certificates in ``pki`` (as
    ``provisionctl certs`` writes them)."""

    def __init__(self, workdir: Path, driver_args: list[str], pki: Path | None = None):
        self.workdir = workdir
        self.pki = pki
        self.services: list[Service] = []
        scheme = "https" if pki else "http"
        try:
            decider = self._start("decider", "decider-svc", [])
            executor = self._start(
                "executor",
                "executor-svc",
                ["--backend", "fake", "--fake-latency-ms", "1,5", "--fake-stage-interval-ms", "5"],
            )
            self.driver = self._start(
                "driver",
                "driver-svc",
                [
                    "--decider",
                    f"{scheme}://{decider.address}",
                    "--executor",
                    f"{scheme}://{executor.address}",
                    "--data-dir",
                    str(workdir / "driver-data"),
                    *driver_args,
                ],
            )
        except BaseException:
            self.stop()
            raise
        self.address = self.driver.address

    def _start(self, name: str, program: str, args: list[str]) -> Service:
        if self.pki is None:
            transport = ["--insecure"]
        else:
            transport = [
                "--tls-ca",
                str(self.pki / "ca.pem"),
                "--tls-cert",
                str(self.pki / f"{program}.pem"),
                "--tls-key",
                str(self.pki / f"{program}.key"),
            ]
        service = Service(name, program, args, self.workdir, transport)
        self.services.append(service)
        return service

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {s.name} ({s.log_path}) -----\n{s.log_tail()}" for s in self.services)


class StackTest(unittest.TestCase):
    """A test class with its own services. ``DRIVER_ARGS`` are the driver's
    extra flags."""

    # The tests call faster than the driver's default rate limit for one
    # address (100 calls a second) allows; RateLimitTest tests the limit.
    DRIVER_ARGS: list[str] = ["--allow-unauthenticated", "--rate-limit", "0"]
    #: Serve over TLS, with certificates from ``provisionctl certs``.
    TLS = False
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        tmp = tempfile.TemporaryDirectory(prefix=f"provisioning-client-{cls.__name__}-")
        cls.addClassCleanup(tmp.cleanup)
        cls.workdir = Path(tmp.name)
        cls.prepare(cls.workdir)
        pki = None
        if cls.TLS:
            pki = cls.workdir / "pki"
            subprocess.run(
                [str(binary("provisionctl")), "certs", "--out", str(pki)],
                check=True,
                capture_output=True,
                timeout=60,
            )
        cls.stack = Stack(cls.workdir, cls.DRIVER_ARGS, pki)
        cls.addClassCleanup(cls.stack.stop)

    @classmethod
    def prepare(cls, workdir: Path) -> None:
        """Writes what the services need before they start."""

    def run(self, result=None):
        result = result if result is not None else self.defaultTestResult()
        before = len(result.failures) + len(result.errors)
        super().run(result)
        stack = getattr(type(self), "stack", None)
        if len(result.failures) + len(result.errors) > before and stack is not None:
            sys.stderr.write(f"\n===== service logs for {self.id()} =====\n{stack.logs()}\n")
        return result

    def client(self, **kwargs) -> Client:
        kwargs.setdefault("insecure", True)
        kwargs.setdefault("timeout", 30.0)
        c = Client(self.stack.address, **kwargs)
        self.addCleanup(c.close)
        return c

    def await_providers_known(self, client: Client) -> None:
        """Waits until the driver's executor link is up and has said what it serves."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if client.providers().known:
                return
            time.sleep(0.05)
        self.fail("the driver never learned what its executor serves")

    def await_gone(self, client: Client, run_id: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                client.get(run_id)
            except NotFound:
                return
            time.sleep(0.05)
        self.fail(f"run {run_id} still exists 30 s after its deletion")


def two_groups(run_id: str, secret: str = SECRET, **extra) -> dict:
    """A shape of two groups, the first with a secret join parameter."""
    shape = {
        "run_id": run_id,
        "groups": [
            {
                "id": "ctrl",
                "count": 2,
                "template": {
                    "role": "control-plane",
                    "image": "registry.local/node:1.0",
                    "provider": {"name": "fake", "machine_type": "standard-8", "cpu": 8, "memory_gib": 32},
                    "boot": {"kernel_args": "quiet"},
                    "join": {"cluster": run_id, "token": {"value": secret, "secret": True}},
                },
            },
            {
                "id": "workers",
                "count": 3,
                "template": {
                    "role": "worker",
                    "image": "registry.local/node:1.0",
                    "provider": {"name": "fake", "labels": {"pool": "general"}},
                },
                "health": {"probe": "none", "interval": "5s"},
                "remediation": {"max_in_flight": 2, "max_unhealthy": "40%"},
            },
        ],
    }
    shape.update(extra)
    return shape


# ---------------------------------------------------------------------------
# A TCP proxy that breaks a connection after the request went through
# ---------------------------------------------------------------------------


class CuttingProxy:
    """Forwards TCP connections to ``upstream``. When armed, it closes the
    connection at the next response the server starts (the first HTTP/2
    HEADERS frame of a stream, server to client): the server has received
    and handled the request, and its answer is lost on the way."""

    def __init__(self, upstream: str):
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.armed = threading.Event()
        self.cuts = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
                upstream = socket.create_connection(self._upstream)
            except OSError:
                return
            with self._lock:
                self._sockets += [downstream, upstream]
            self._spawn(self._forward, downstream, upstream)
            self._spawn(self._forward_responses, upstream, downstream)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        self._close(src, dst)

    def _forward_responses(self, src: socket.socket, dst: socket.socket) -> None:
        # The server's side of HTTP/2 is frames from the first byte (the
        # client alone sends a preface): 3 bytes length, type, flags, stream.
        buf = b""
        try:
            while data := src.recv(65536):
                buf += data
                out = b""
                while len(buf) >= 9:
                    length = int.from_bytes(buf[0:3], "big")
                    if len(buf) < 9 + length:
                        break
                    frame_type = buf[3]
                    stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                    frame, buf = buf[: 9 + length], buf[9 + length :]
                    if frame_type == 0x1 and stream != 0 and self.armed.is_set():
                        self.armed.clear()
                        self.cuts += 1
                        if out:
                            dst.sendall(out)
                        self._close(src, dst)
                        return
                    out += frame
                if out:
                    dst.sendall(out)
        except OSError:
            pass
        self._close(src, dst)

    def close(self) -> None:
        self._close(self._listener)
        with self._lock:
            self._close(*self._sockets)
        for t in self._threads:
            t.join(timeout=5)


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# Unit tests: shapes
# ---------------------------------------------------------------------------


class ShapeConversionTest(unittest.TestCase):
    def test_a_two_group_shape_converts_with_its_secret_and_params(self):
        shape = two_groups("demo")
        shape["groups"][0]["template"]["boot"].update({"port": 8080, "debug": False, "flag": "yes"})
        msg = shape_to_proto(shape, generation=4)
        self.assertEqual((msg.run_id, msg.generation, len(msg.groups)), ("demo", 4, 2))
        ctrl = msg.groups[0]
        self.assertEqual((ctrl.id, ctrl.count, ctrl.template.role), ("ctrl", 2, "control-plane"))
        self.assertEqual(ctrl.template.provider.cpu, 8.0)
        self.assertEqual(ctrl.template.join["token"].value, SECRET)
        self.assertTrue(ctrl.template.join["token"].secret)
        self.assertFalse(ctrl.template.join["cluster"].secret)
        boot = ctrl.template.boot
        self.assertEqual(
            (boot["port"].value, boot["debug"].value, boot["flag"].value, boot["kernel_args"].value),
            ("8080", "false", "yes", "quiet"),
        )
        # Unset policies stay unset (the driver's defaults apply).
        self.assertFalse(ctrl.HasField("health") or ctrl.HasField("remediation") or ctrl.HasField("rollout"))
        self.assertEqual(dict(msg.groups[1].template.provider.labels), {"pool": "general"})

    @unittest.skipUnless(HAS_LABELS, "the proto has no run labels")
    def test_run_labels_convert_and_are_content(self):
        msg = shape_to_proto(two_groups("demo", labels={"team": "ml", "env": "prod"}), generation=1)
        self.assertEqual(dict(msg.labels), {"team": "ml", "env": "prod"})
        with self.assertRaises(InvalidShape) as ctx:
            shape_to_proto(two_groups("demo", labels={"team": 3.5}))
        self.assertEqual(ctx.exception.field, 'shape.labels["team"]')
        other = shape_to_proto(two_groups("demo", labels={"team": "web", "env": "prod"}), generation=1)
        self.assertFalse(same_content(msg, other))

    def test_the_shape_names_its_own_generation(self):
        self.assertEqual(shape_to_proto(two_groups("demo", generation=7), generation=2).generation, 7)
        self.assertEqual(shape_to_proto(two_groups("demo")).generation, 0)

    def test_policies_convert_with_durations_and_budgets(self):
        shape = two_groups("demo")
        shape["groups"][1]["health"] = {
            "probe": "tcp",
            "interval": "500ms",
            "timeout": 200,
            "unhealthy_after": "2m",
            "startup_grace": "1h",
        }
        shape["groups"][1]["remediation"] = {"max_in_flight": 0, "max_unhealthy": "40%"}
        shape["groups"][1]["rollout"] = {
            "max_unavailable": 0,
            "max_surge": "2",
            "canary": 1,
            "progress_deadline": "10s",
            "failure_threshold": 3,
            "auto_revert": True,
        }
        g = shape_to_proto(shape).groups[1]
        self.assertEqual(g.health.probe, pb.PROBE_TCP)
        self.assertEqual(
            (g.health.interval_ms, g.health.timeout_ms, g.health.unhealthy_after_ms, g.health.startup_grace_ms),
            (500, 200, 120_000, 3_600_000),
        )
        # max_in_flight 0 is "report, never replace", not "unset".
        self.assertTrue(g.remediation.HasField("max_in_flight"))
        self.assertEqual(g.remediation.max_in_flight, 0)
        self.assertEqual(g.remediation.max_unhealthy.percent, 40)
        self.assertEqual(g.rollout.max_unavailable.WhichOneof("value"), "count")
        self.assertEqual(g.rollout.max_unavailable.count, 0)
        self.assertEqual(g.rollout.max_surge.count, 2)
        self.assertEqual(
            (g.rollout.canary, g.rollout.progress_deadline_ms, g.rollout.failure_threshold, g.rollout.auto_revert),
            (1, 10_000, 3, True),
        )

    def test_durations(self):
        cases = [("90", 90), ("1500ms", 1500), ("10s", 10_000), ("2m", 120_000), ("1h", 3_600_000), (7, 7)]
        for text, ms in cases:
            self.assertEqual(parse_duration_ms(text), ms, text)
        for bad in ["10 parsecs", "-1s", "1.5s", "", True, -3]:
            with self.assertRaises(InvalidShape, msg=repr(bad)):
                parse_duration_ms(bad, "shape.groups[0].health.interval")

    def test_format_errors_name_the_field_and_send_nothing(self):
        cases = [
            (lambda s: s["groups"][1].update(colour="blue"), "shape.groups[1].colour"),
            (lambda s: s["groups"][0].pop("count"), "shape.groups[0].count"),
            (lambda s: s["groups"][0].update(count="two"), "shape.groups[0].count"),
            (lambda s: s["groups"][0]["template"].pop("image"), "shape.groups[0].template.image"),
            (
                lambda s: s["groups"][0]["template"]["provider"].pop("name"),
                "shape.groups[0].template.provider.name",
            ),
            (lambda s: s["groups"][1].update(health={"probe": "http"}), "shape.groups[1].health.probe"),
            (lambda s: s["groups"][1].update(remediation={"max_unhealthy": "lots"}),
             "shape.groups[1].remediation.max_unhealthy"),
            (
                lambda s: s["groups"][0]["template"]["boot"].update(ratio=1.10),
                'shape.groups[0].template.boot["ratio"]',
            ),
            (lambda s: s.pop("run_id"), "shape.run_id"),
        ]
        for change, field in cases:
            shape = two_groups("demo")
            change(shape)
            with self.assertRaises(InvalidShape, msg=field) as ctx:
                shape_to_proto(shape)
            self.assertEqual(ctx.exception.field, field)
            self.assertEqual(ctx.exception.status_code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("nothing was sent", str(ctx.exception))
            self.assertNotIn(SECRET, str(ctx.exception) + repr(ctx.exception))

    def test_a_malformed_secret_param_never_shows_its_value(self):
        for bad in (
            {"value": SECRET, "secret": True, "colour": "red"},
            {"value": SECRET, "secret": "maybe"},
            {"value": SECRET, "from_env": "PATH", "secret": True},
        ):
            shape = two_groups("demo")
            shape["groups"][0]["template"]["join"]["token"] = bad
            with self.assertRaises(InvalidShape) as ctx:
                shape_to_proto(shape)
            self.assertTrue(ctx.exception.field.startswith('shape.groups[0].template.join["token"]'))
            self.assertNotIn(SECRET, str(ctx.exception) + repr(ctx.exception))

    def test_a_secret_can_come_from_the_environment_or_a_file(self):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "token"
            path.write_text("from-a-file\n")
            shape = two_groups("demo")
            shape["groups"][0]["template"]["join"]["token"] = {"from_file": str(path), "secret": True}
            shape["groups"][0]["template"]["boot"]["home"] = {"from_env": "PROVISIONING_CLIENT_TEST_VAR"}
            os.environ["PROVISIONING_CLIENT_TEST_VAR"] = "from-the-env"
            try:
                t = shape_to_proto(shape).groups[0].template
            finally:
                del os.environ["PROVISIONING_CLIENT_TEST_VAR"]
            self.assertEqual((t.join["token"].value, t.join["token"].secret), ("from-a-file", True))
            self.assertEqual((t.boot["home"].value, t.boot["home"].secret), ("from-the-env", False))
            shape["groups"][0]["template"]["boot"]["home"] = {"from_env": "PROVISIONING_CLIENT_NEVER_SET"}
            with self.assertRaises(InvalidShape) as ctx:
                shape_to_proto(shape)
            self.assertIn("PROVISIONING_CLIENT_NEVER_SET", str(ctx.exception))

    def test_the_redaction_marker_as_a_secret_is_refused(self):
        # What get() returns for a secret: applying it back would set the
        # secret to the marker itself.
        shape = two_groups("demo", secret="<redacted>")
        with self.assertRaises(InvalidShape) as ctx:
            shape_to_proto(shape)
        self.assertEqual(ctx.exception.field, 'shape.groups[0].template.join["token"]')
        # Not secret: a value like any other.
        shape = two_groups("demo")
        shape["groups"][0]["template"]["boot"]["x"] = "<redacted>"
        shape_to_proto(shape)

    def test_yaml_reads_as_provisionctl_reads_it(self):
        text = (
            "run_id: demo\n"
            "groups:\n"
            "  - id: w\n"
            "    count: 2\n"
            "    template:\n"
            "      image: 1.0\n"
            "      provider: { name: fake, cpu: 2.5 }\n"
            "      boot: { a: yes, port: 8080, on: off, t: { value: s3cret, secret: true } }\n"
            "    remediation: { max_unhealthy: 40% }\n"
        )
        msg = shape_to_proto(parse_shape_text(text, "s.yaml"))
        t = msg.groups[0].template
        self.assertEqual(t.image, "1.0")
        self.assertEqual(t.provider.cpu, 2.5)
        self.assertEqual(
            {k: v.value for k, v in t.boot.items()}, {"a": "yes", "port": "8080", "on": "off", "t": "s3cret"}
        )
        self.assertTrue(t.boot["t"].secret)
        self.assertEqual(msg.groups[0].remediation.max_unhealthy.percent, 40)

    def test_bad_files_say_where_without_quoting_them(self):
        with self.assertRaises(InvalidShape) as ctx:
            parse_shape_text('{"run_id": "demo",, }', "s.json")
        self.assertTrue(str(ctx.exception).startswith("s.json:1:"), str(ctx.exception))
        with self.assertRaises(InvalidShape) as ctx:
            parse_shape_text("run_id: demo\ngroups: [\n", "s.yaml")
        self.assertIn("s.yaml:", str(ctx.exception))
        with self.assertRaises(InvalidShape):
            parse_shape_text("  \n", "s.yaml")

    def test_the_shipped_examples_load(self):
        examples = sorted((REPO / "deploy" / "examples").glob("*.*"))
        loaded = 0
        for path in examples:
            if path.suffix in (".yaml", ".json"):
                msg = shape_to_proto(load_shape_file(path))
                self.assertTrue(msg.run_id and msg.groups, path)
                loaded += 1
        self.assertGreaterEqual(loaded, 3)
        demo = shape_to_proto(load_shape_file(REPO / "deploy" / "examples" / "shape.json"))
        self.assertTrue(demo.groups[0].template.join["token"].secret)

    def test_same_content_reads_unset_policies_as_the_defaults_and_ignores_secrets(self):
        mine = shape_to_proto(two_groups("demo"), generation=1)
        # As the driver returns it: policies spelled out, secrets redacted.
        theirs = pb.ClusterShape()
        theirs.CopyFrom(mine)
        theirs.generation = 5
        for g in theirs.groups:
            g.health.probe = g.health.probe or pb.PROBE_NONE
            g.health.interval_ms = g.health.interval_ms or 10_000
            g.health.timeout_ms, g.health.unhealthy_after_ms = 2_000, 30_000
            if not g.remediation.HasField("max_in_flight"):
                g.remediation.max_in_flight = 1
            if not g.remediation.HasField("max_unhealthy"):
                g.remediation.max_unhealthy.percent = 100
            g.rollout.max_unavailable.percent = 25
            g.rollout.max_surge.percent = 25
            g.rollout.progress_deadline_ms = 600_000
            for p in list(g.template.join.values()) + list(g.template.boot.values()):
                if p.secret:
                    p.value = "<redacted>"
        self.assertTrue(same_content(mine, theirs))
        other = shape_to_proto(two_groups("demo", secret="another"), generation=1)
        self.assertTrue(same_content(other, theirs), "a secret's value cannot be compared")
        theirs.groups[1].count = 4
        self.assertFalse(same_content(mine, theirs))


# ---------------------------------------------------------------------------
# Unit tests: errors
# ---------------------------------------------------------------------------


class FakeRpcError(grpc.RpcError, grpc.Call):
    """An ``RpcError`` as the gRPC library raises it, with chosen contents.
    ``server`` gives it the response metadata a status from the server has."""

    def __init__(self, code: grpc.StatusCode, details: str, *, server: bool = True, trailers=()):
        super().__init__()
        self._code = code
        self._details = details
        self._trailers = tuple(trailers) + ((("date", "Mon, 01 Jan 2029 00:00:00 GMT"),) if server else ())

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers

    def initial_metadata(self):
        return ()

    def debug_error_string(self):
        return f"{self._code.name}:{self._details}"

    # grpc.Call's other abstract methods.
    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


class ErrorMappingTest(unittest.TestCase):
    def test_statuses_map_to_their_exceptions(self):
        C = grpc.StatusCode
        for code, cls in [
            (C.NOT_FOUND, NotFound),
            (C.FAILED_PRECONDITION, Conflict),
            (C.ALREADY_EXISTS, Conflict),
            (C.UNAUTHENTICATED, Unauthenticated),
            (C.PERMISSION_DENIED, PermissionDenied),
            (C.UNAVAILABLE, Unavailable),
            (C.RESOURCE_EXHAUSTED, ResourceExhausted),
            (C.DEADLINE_EXCEEDED, Timeout),
            (C.INVALID_ARGUMENT, InvalidArgument),
            (C.INTERNAL, ProvisioningError),
            (C.UNIMPLEMENTED, ProvisioningError),
        ]:
            e = errs.from_rpc_error(FakeRpcError(code, "it said no"), "get run demo")
            self.assertIs(type(e), cls, code)
            self.assertEqual(e.status_code, code)
            self.assertEqual(str(e), "get run demo: it said no")

    def test_an_invalid_shape_names_its_field(self):
        err = FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "shape.groups[0].count must not be negative")
        e = errs.from_rpc_error(err, "apply run demo", change=True, shape=True)
        self.assertIsInstance(e, InvalidShape)
        self.assertEqual(e.field, "shape.groups[0].count")
        err = FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "run_id is malformed: expected lowercase letters")
        e = errs.from_rpc_error(err, "get run Demo")
        self.assertIs(type(e), InvalidArgument)
        self.assertEqual(e.field, "run_id")

    def test_field_paths_are_read_from_the_message_start(self):
        for message, field in [
            (
                'shape.groups[0].template.provider.name is "gcp", which the executor does not serve',
                "shape.groups[0].template.provider.name",
            ),
            (
                'shape.groups[1].template.boot["a key"] is 5000 bytes long',
                'shape.groups[1].template.boot["a key"]',
            ),
            ("shape is required", "shape"),
            ("group_id: no such group", "group_id"),
            ("failed to decode Protobuf message", None),
            ("shape.groups[0].count", None),
            ("", None),
        ]:
            self.assertEqual(errs.field_of(message), field, message)

    def test_a_change_whose_answer_was_lost_has_an_unknown_outcome(self):
        broken = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", server=False)
        e = errs.from_rpc_error(broken, "apply run demo", change=True, check_with="get('demo')")
        self.assertIsInstance(e, OutcomeUnknown)
        self.assertIn("get('demo')", str(e))
        self.assertIn("may or may not have taken effect", str(e))
        late = FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", server=False)
        self.assertIsInstance(errs.from_rpc_error(late, "delete run demo", change=True), OutcomeUnknown)
        reset = FakeRpcError(grpc.StatusCode.UNKNOWN, "Stream removed (Connection reset by peer)", server=False)
        self.assertIsInstance(errs.from_rpc_error(reset, "pause run demo", change=True), OutcomeUnknown)
        # The same failures of a read are what they are.
        self.assertIsInstance(errs.from_rpc_error(broken, "get run demo"), Unavailable)
        self.assertIsInstance(errs.from_rpc_error(late, "get run demo"), Timeout)

    def test_a_change_never_sent_or_answered_by_the_server_has_a_known_outcome(self):
        refused = FakeRpcError(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
            "Failed to connect to remote host: Connection refused",
            server=False,
        )
        e = errs.from_rpc_error(refused, "apply run demo", change=True)
        self.assertIs(type(e), Unavailable)
        self.assertIn("nothing was sent", str(e))
        said = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "the decider is unreachable")
        self.assertIs(type(errs.from_rpc_error(said, "apply run demo", change=True)), Unavailable)
        internal = FakeRpcError(grpc.StatusCode.INTERNAL, "store: unknown run")
        self.assertIs(type(errs.from_rpc_error(internal, "apply run demo", change=True)), ProvisioningError)

    def test_the_retry_hint_is_read(self):
        err = FakeRpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "over its rate limit", trailers=[("grpc-retry-pushback-ms", "250")]
        )
        self.assertEqual(errs.retry_pushback(err), 0.25)
        e = errs.from_rpc_error(err, "apply run demo", change=True)
        self.assertIsInstance(e, ResourceExhausted)
        self.assertEqual(e.retry_after, 0.25)
        self.assertIsNone(errs.retry_pushback(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too large")))
        bad = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", trailers=[("grpc-retry-pushback-ms", "-1")])
        self.assertEqual(errs.retry_pushback(bad), -1.0)

    def test_secrets_are_hidden_from_messages_and_reprs(self):
        message = f'shape.groups[0].template.join["token"] is "{SECRET}"'
        err = FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, message)
        e = errs.from_rpc_error(err, "apply run demo", change=True, shape=True, secrets=[SECRET, "s3cret"])
        self.assertNotIn(SECRET, str(e))
        self.assertNotIn(SECRET, repr(e))
        self.assertNotIn("s3cret", str(e))
        self.assertIn("<redacted>", str(e))
        self.assertEqual(e.field, 'shape.groups[0].template.join["token"]')
        self.assertTrue(repr(e).startswith("InvalidShape(status_code=INVALID_ARGUMENT"), repr(e))


# ---------------------------------------------------------------------------
# Unit tests: settings
# ---------------------------------------------------------------------------


class SettingsTest(unittest.TestCase):
    def test_booleans_read_as_provisionctl_reads_them(self):
        for text in ["1", "true", "TRUE", "yes", "Yes", "on", "y", "t"]:
            self.assertTrue(pc.parse_bool(text), text)
        for text in ["0", "false", "False", "no", "NO", "off", "n", "f"]:
            self.assertFalse(pc.parse_bool(text), text)
        with self.assertRaises(ValueError) as ctx:
            pc.parse_bool("maybe", "PROVISIONCTL_INSECURE")
        self.assertIn("PROVISIONCTL_INSECURE", str(ctx.exception))

    def test_the_provisionctl_variables(self):
        self.assertEqual(pc.settings_from_env({}), {"target": "127.0.0.1:7000", "insecure": False})
        s = pc.settings_from_env(
            {
                "PROVISIONCTL_SERVER": "driver:7443",
                "PROVISIONCTL_TLS_CA": "/pki/ca.pem",
                "PROVISIONCTL_TLS_CERT": "/pki/me.pem",
                "PROVISIONCTL_TLS_KEY": "/pki/me.key",
                "PROVISIONCTL_TOKEN_FILE": "/secrets/me.token",
                "PROVISIONCTL_TOKEN": "prov_ignored_since_the_file_wins",
                "PROVISIONCTL_INSECURE": "no",
            }
        )
        self.assertEqual(s["target"], "driver:7443")
        self.assertEqual(s["tls"], TlsConfig(ca="/pki/ca.pem", cert="/pki/me.pem", key="/pki/me.key"))
        self.assertEqual(s["token_file"], "/secrets/me.token")
        self.assertNotIn("token", s)
        self.assertFalse(s["insecure"])
        s = pc.settings_from_env(
            {"PROVISIONCTL_INSECURE": "1", "PROVISIONCTL_TOKEN": "prov_abc", "PROVISIONCTL_TLS_CA": ""}
        )
        self.assertEqual((s["insecure"], s["token"], "tls" in s), (True, "prov_abc", False))
        with self.assertRaises(ValueError):
            pc.settings_from_env({"PROVISIONCTL_INSECURE": "sometimes"})
        with self.assertRaises(ValueError):
            pc.settings_from_env({"PROVISIONCTL_TLS_CA": "ca.pem", "PROVISIONCTL_TLS_CERT": "me.pem"})

    def test_from_env_builds_a_client_and_overrides_win(self):
        with tempfile.TemporaryDirectory() as d:
            token = Path(d) / "me.token"
            token.write_text("prov_0123456789abcdef\n")
            env = {"PROVISIONCTL_SERVER": "http://127.0.0.1:1", "PROVISIONCTL_INSECURE": "true",
                   "PROVISIONCTL_TOKEN_FILE": str(token)}
            with Client.from_env(env, timeout=5) as c:
                self.assertEqual((c.target, c.timeout), ("http://127.0.0.1:1", 5.0))
                self.assertNotIn("prov_0123456789abcdef", repr(c))
                self.assertIn("<redacted>", repr(c))
            with Client.from_env(env, token=None) as c:
                self.assertIn("token=None", repr(c))
        with self.assertRaises(ValueError):
            Client.from_env({"PROVISIONCTL_SERVER": "127.0.0.1:1"})  # neither TLS nor insecure

    def test_transport_and_token_mistakes_are_refused(self):
        with self.assertRaises(ValueError):
            Client("127.0.0.1:1")
        with self.assertRaises(ValueError):
            Client("127.0.0.1:1", insecure=True, tls=TlsConfig(ca=None))
        with self.assertRaises(ValueError):
            Client("https://127.0.0.1:1", insecure=True)
        with self.assertRaises(ValueError):
            Client("http://127.0.0.1:1", tls=TlsConfig())
        with self.assertRaises(ValueError):
            Client("127.0.0.1:1", insecure=True, token="two words")
        with self.assertRaises(ValueError):
            TlsConfig(ca="ca.pem", cert="me.pem")


# ---------------------------------------------------------------------------
# Against the services
# ---------------------------------------------------------------------------


class DriverTest(StackTest):
    """The public API of a driver without authentication."""

    def test_apply_a_dict_and_wait_until_converged(self):
        c = self.client()
        r = c.apply(two_groups("apply-wait"))
        self.assertTrue(r.created and r.changed)
        self.assertEqual(r.generation, 1)
        self.assertEqual(len(r.run_uid), 32)
        status = c.wait("apply-wait", timeout=60)
        self.assertTrue(status.converged)
        self.assertEqual(status.phase, pb.RUN_PHASE_CONVERGED)
        self.assertEqual((status.generation, status.ready_count), (1, 5))
        self.assertEqual(
            {g.group_id: (g.desired, g.ready) for g in status.groups}, {"ctrl": (2, 2), "workers": (3, 3)}
        )
        # The policies the shape gave are what the driver holds.
        workers = [g for g in status.shape.groups if g.id == "workers"][0]
        self.assertEqual((workers.health.interval_ms, workers.remediation.max_in_flight), (5000, 2))

    def test_applying_the_same_file_again_changes_nothing(self):
        c = self.client()
        path = self.workdir / "same.yaml"
        path.write_text(yaml.safe_dump(two_groups("same-file")))
        first = c.apply_file(path)
        self.assertEqual((first.generation, first.created), (1, True))
        c.wait("same-file", timeout=60)
        again = c.apply_file(path)
        self.assertEqual((again.generation, again.changed, again.created), (1, False, False))
        self.assertEqual(c.get("same-file").generation, 1)
        # A real change is the next generation; the plan of the file at that
        # point sees it.
        changed = two_groups("same-file")
        changed["groups"][1]["count"] = 4
        plan = c.plan(changed)
        self.assertEqual(plan.current_generation, 1)
        self.assertIn("workers-3", {d.node_id for d in plan.decisions})
        self.assertEqual(c.get("same-file").generation, 1, "a plan records nothing")
        r = c.apply(changed)
        self.assertEqual((r.generation, r.changed), (2, True))
        self.assertEqual(c.wait("same-file", timeout=60, generation=2).ready_count, 6)

    def test_a_changed_secret_alone_is_a_new_generation(self):
        c = self.client()
        c.apply(two_groups("secret-change"))
        r = c.apply(two_groups("secret-change", secret="a-rotated-token"))
        self.assertEqual((r.generation, r.changed), (2, True))

    @unittest.skipUnless(HAS_LABELS, "the proto has no run labels")
    def test_run_labels_are_kept_and_are_content(self):
        c = self.client()
        r = c.apply(two_groups("labelled", labels={"team": "ml"}))
        self.assertEqual(dict(c.get("labelled").labels), {"team": "ml"})
        again = c.apply(two_groups("labelled", labels={"team": "ml"}))
        self.assertEqual((again.generation, again.changed), (r.generation, False))
        relabelled = c.apply(two_groups("labelled", labels={"team": "web"}))
        self.assertEqual((relabelled.generation, relabelled.changed), (r.generation + 1, True))
        with self.assertRaises(InvalidShape) as ctx:
            c.apply(two_groups("labelled", labels={"bad key": "x"}))
        self.assertEqual(ctx.exception.field, 'shape.labels["bad key"]')
        c.apply(two_groups("unlabelled"))
        selected = {s.run_id for s in c.list("team=web")}
        self.assertIn("labelled", selected)
        self.assertNotIn("unlabelled", selected)
        self.assertNotIn("labelled", {s.run_id for s in c.list("!team")})

    def test_watch_yields_statuses_until_converged_and_ends_at_deletion(self):
        c = self.client()
        c.apply(two_groups("watched"))
        seen = []
        for status in c.watch("watched", timeout=60):
            seen.append(status)
            if status.converged:
                break
        self.assertTrue(seen[-1].converged)
        self.assertTrue(all(s.run_id == "watched" for s in seen))
        self.assertEqual(seen[-1].ready_count, 5)
        with_nodes = next(iter(c.watch("watched", nodes=True, timeout=30)))
        self.assertEqual(len(with_nodes.nodes), 5)
        c.delete("watched")
        phases = [s.phase for s in c.watch("watched", timeout=60)]
        self.assertEqual(phases[-1], pb.RUN_PHASE_DELETED)
        self.await_gone(c, "watched")

    def test_explain_a_node(self):
        c = self.client()
        c.apply(two_groups("explained"))
        c.wait("explained", timeout=60)
        e = c.explain("explained", "workers-1")
        self.assertEqual((e.node.state.node_id, e.node.group_id), ("workers-1", "workers"))
        self.assertEqual(e.decision.node_id, "workers-1")
        self.assertGreater(e.now_ms, 0)
        with self.assertRaises(NotFound):
            c.explain("explained", "workers-9")
        # A page a time, one slot each, the same nodes as the whole status.
        paged = [n.state.node_id for n in c.nodes("explained", page_size=1)]
        whole = [n.state.node_id for n in c.get("explained", nodes=True).nodes]
        self.assertEqual(paged, whole)
        self.assertGreater(len(paged), 1)
        with self.assertRaises(NotFound):
            list(c.nodes("nope"))

    def test_list_events_and_providers(self):
        c = self.client()
        c.apply(two_groups("listed"))
        c.wait("listed", timeout=60)
        runs = {s.run_id: s for s in c.list()}
        self.assertIn("listed", runs)
        self.assertEqual(runs["listed"].generation, 1)
        events = c.events("listed")
        reasons = [e.reason for e in events.events]
        self.assertIn("Applied", reasons)
        self.assertGreaterEqual(events.last_seq, len(reasons))
        self.await_providers_known(c)
        providers = c.providers()
        self.assertIn("fake", [p.name for p in providers.providers])

    def test_pause_and_resume(self):
        c = self.client()
        c.apply(two_groups("paused"))
        self.assertTrue(c.pause("paused").paused)
        self.assertEqual(c.get("paused").phase, pb.RUN_PHASE_PAUSED)
        self.assertFalse(c.resume("paused").paused)
        c.wait("paused", timeout=60)

    def test_an_invalid_shape_names_its_field_and_changes_nothing(self):
        c = self.client()
        for change, field in [
            (lambda s: s["groups"][0].update(count=-1), "shape.groups[0].count"),
            (lambda s: s["groups"][1]["template"].update(image=""), "shape.groups[1].template.image"),
        ]:
            shape = two_groups("invalid-new")
            change(shape)
            with self.assertRaises(InvalidShape) as ctx:
                c.apply(shape)
            self.assertEqual(ctx.exception.field, field)
            self.assertEqual(ctx.exception.status_code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertNotIn(SECRET, str(ctx.exception) + repr(ctx.exception))
            with self.assertRaises(NotFound):
                c.get("invalid-new")
        # An existing run keeps its generation and content.
        c.apply(two_groups("invalid-old"))
        bad = two_groups("invalid-old")
        bad["groups"][0]["count"] = -1
        with self.assertRaises(InvalidShape):
            c.apply(bad)
        status = c.get("invalid-old")
        self.assertEqual(status.generation, 1)
        self.assertEqual(status.shape.groups[0].count, 2)
        with self.assertRaises(InvalidShape):
            c.plan(bad)

    def test_a_provider_the_executor_does_not_serve_is_refused(self):
        c = self.client()
        self.await_providers_known(c)
        shape = two_groups("gcp-run")
        shape["groups"][0]["template"]["provider"]["name"] = "gcp"
        with self.assertRaises(InvalidShape) as ctx:
            c.apply(shape)
        self.assertEqual(ctx.exception.field, "shape.groups[0].template.provider.name")
        self.assertIn("gcp", str(ctx.exception))
        with self.assertRaises(NotFound):
            c.get("gcp-run")

    def test_unknown_runs(self):
        c = self.client()
        with self.assertRaises(NotFound) as ctx:
            c.get("no-such-run")
        self.assertEqual(ctx.exception.status_code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(NotFound):
            c.delete("no-such-run")
        self.assertIsNone(c.delete("no-such-run", ignore_not_found=True))
        with self.assertRaises(NotFound):
            c.wait("no-such-run", timeout=10)
        with self.assertRaises(InvalidArgument) as ctx:
            c.get("Not_A_Run_Id")
        self.assertEqual(ctx.exception.field, "run_id")

    def test_delete_then_the_run_is_gone(self):
        c = self.client()
        c.apply(two_groups("deleted"))
        c.wait("deleted", timeout=60)
        status = c.delete("deleted")
        self.assertIn(status.phase, (pb.RUN_PHASE_DELETING, pb.RUN_PHASE_DELETED))
        self.await_gone(c, "deleted")
        self.assertNotIn("deleted", [s.run_id for s in c.list()])

    def test_a_run_that_cannot_converge_is_stalled(self):
        c = self.client()
        shape = two_groups("stalled")
        shape["groups"][1]["template"]["image"] = "invalid:1.0"  # refused for good by the fake provider
        c.apply(shape)
        with self.assertRaises(Stalled) as ctx:
            c.wait("stalled", timeout=60)
        self.assertIn("stalled", str(ctx.exception))
        self.assertFalse(ctx.exception.status.converged)

    def test_wait_times_out(self):
        c = self.client()
        c.apply(two_groups("slow"))
        with self.assertRaises(Timeout) as ctx:
            c.wait("slow", timeout=0.5, generation=99)  # a generation it never reaches
        self.assertIn("did not converge", str(ctx.exception))

    def test_the_secret_never_appears_in_what_the_client_returns_or_raises(self):
        c = self.client()
        c.apply(two_groups("secretive"))
        c.wait("secretive", timeout=60)
        shown = [
            c.get("secretive", nodes=True),
            c.list(),
            next(iter(c.watch("secretive", nodes=True, timeout=30))),
            c.explain("secretive", "ctrl-0"),
            c.events("secretive"),
            c.plan(two_groups("secretive")),
        ]
        for thing in shown:
            self.assertNotIn(SECRET, str(thing))
            self.assertNotIn(SECRET, repr(thing))
        token = c.get("secretive").shape.groups[0].template.join["token"]
        self.assertEqual((token.value, token.secret), ("<redacted>", True))
        # Applying the status's shape back is refused locally: it would set
        # the secret to the marker.
        with self.assertRaises(InvalidShape):
            c.apply({"run_id": "secretive", "groups": [{
                "id": "ctrl", "count": 1,
                "template": {"image": "i", "provider": {"name": "fake"},
                             "join": {"token": {"value": token.value, "secret": True}}}}]})
        bad = two_groups("secretive")
        bad["groups"][1]["count"] = -2
        with self.assertRaises(InvalidShape) as ctx:
            c.apply(bad)
        self.assertNotIn(SECRET, str(ctx.exception) + repr(ctx.exception))
        self.assertNotIn(SECRET, repr(c))

    def test_a_change_whose_answer_is_lost_is_outcome_unknown(self):
        proxy = CuttingProxy(self.stack.address)
        self.addCleanup(proxy.close)
        via = Client(proxy.address, insecure=True, timeout=30)
        self.addCleanup(via.close)
        proxy.armed.set()
        with self.assertRaises(OutcomeUnknown) as ctx:
            via.apply(two_groups("lost-answer", generation=1))
        self.assertEqual(proxy.cuts, 1)
        self.assertIn("get('lost-answer')", str(ctx.exception))
        self.assertNotIn(SECRET, str(ctx.exception) + repr(ctx.exception))
        # The change did take effect: only asking says so.
        self.assertEqual(self.client().get("lost-answer").generation, 1)

    def test_reads_and_watches_survive_a_broken_connection(self):
        c = self.client()
        c.apply(two_groups("reconnected"))
        proxy = CuttingProxy(self.stack.address)
        self.addCleanup(proxy.close)
        via = Client(proxy.address, insecure=True, timeout=30)
        self.addCleanup(via.close)
        proxy.armed.set()
        self.assertEqual(via.get("reconnected").run_id, "reconnected")
        self.assertEqual(proxy.cuts, 1)
        proxy.armed.set()
        self.assertTrue(via.wait("reconnected", timeout=60).converged)
        self.assertEqual(proxy.cuts, 2)

    def test_a_change_that_cannot_be_sent_is_unavailable(self):
        c = Client(f"127.0.0.1:{free_port()}", insecure=True, timeout=10, retries=1)
        self.addCleanup(c.close)
        with self.assertRaises(Unavailable) as ctx:
            c.apply(two_groups("never-sent", generation=1))
        self.assertNotIsInstance(ctx.exception, OutcomeUnknown)
        self.assertIn("nothing was sent", str(ctx.exception))
        with self.assertRaises(Unavailable):
            c.get("never-sent")


class AuthTest(StackTest):
    """A driver that requires bearer tokens (``--tokens-file``)."""

    DRIVER_ARGS: list[str] = []  # set in prepare

    @classmethod
    def prepare(cls, workdir: Path) -> None:
        entries = []
        for name, access in (("writer", "write"), ("reader", "read")):
            token_file = workdir / f"{name}.token"
            out = subprocess.run(
                [str(binary("provisionctl")), "token", "new", name, "--access", access, "--save", str(token_file)],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            )
            entries.append(out.stdout)
        tokens = workdir / "tokens.yaml"
        tokens.write_text("".join(entries))
        cls.DRIVER_ARGS = ["--tokens-file", str(tokens), "--rate-limit", "0"]

    def test_no_token_is_unauthenticated(self):
        c = self.client()
        with self.assertRaises(Unauthenticated) as ctx:
            c.list()
        self.assertIn("bearer token", str(ctx.exception))
        with self.assertRaises(Unauthenticated):
            c.apply(two_groups("anonymous", generation=1))

    def test_an_unknown_token_is_unauthenticated_and_never_shown(self):
        c = self.client(token="prov_not_a_token_this_driver_knows")
        with self.assertRaises(Unauthenticated) as ctx:
            c.get("anything")
        self.assertNotIn("prov_not_a_token_this_driver_knows", str(ctx.exception))
        self.assertNotIn("prov_not_a_token_this_driver_knows", repr(c))

    def test_a_read_token_reads_but_cannot_apply(self):
        reader = self.client(token_file=self.workdir / "reader.token")
        self.assertIsInstance(reader.list(), list)
        self.assertIsInstance(reader.providers().known, bool)
        with self.assertRaises(PermissionDenied) as ctx:
            reader.apply(two_groups("read-only"))
        self.assertIn("write", str(ctx.exception))
        writer = self.client(token_file=self.workdir / "writer.token")
        with self.assertRaises(NotFound):
            writer.get("read-only")

    def test_a_write_token_applies(self):
        writer = self.client(token_file=self.workdir / "writer.token")
        r = writer.apply(two_groups("written"))
        self.assertTrue(r.created)
        self.assertTrue(writer.wait("written", timeout=60).converged)
        reader = self.client(token_file=self.workdir / "reader.token")
        self.assertEqual(reader.get("written").generation, 1)
        with self.assertRaises(PermissionDenied):
            reader.delete("written")
        writer.delete("written")
        self.await_gone(writer, "written")


class TlsTest(StackTest):
    """A driver that serves TLS (client certificates optional)."""

    TLS = True

    def tls(self, **kwargs) -> TlsConfig:
        return TlsConfig(ca=self.stack.pki / "ca.pem", **kwargs)

    def test_apply_over_tls_with_and_without_a_client_certificate(self):
        pki = self.stack.pki
        with_cert = self.client(
            insecure=False, tls=self.tls(cert=pki / "provisionctl.pem", key=pki / "provisionctl.key")
        )
        with_cert.apply(two_groups("over-tls"))
        self.assertTrue(with_cert.wait("over-tls", timeout=60).converged)
        plain = Client(f"https://{self.stack.address}", tls=self.tls(), timeout=30)
        self.addCleanup(plain.close)
        self.assertEqual(plain.get("over-tls").generation, 1)
        env = {
            "PROVISIONCTL_SERVER": self.stack.address,
            "PROVISIONCTL_TLS_CA": str(pki / "ca.pem"),
            "PROVISIONCTL_TLS_CERT": str(pki / "provisionctl.pem"),
            "PROVISIONCTL_TLS_KEY": str(pki / "provisionctl.key"),
        }
        with Client.from_env(env) as from_env:
            self.assertIn("over-tls", [s.run_id for s in from_env.list()])

    def test_a_driver_the_ca_does_not_vouch_for_is_unavailable(self):
        other = self.workdir / "other-pki"
        subprocess.run(
            [str(binary("provisionctl")), "certs", "--out", str(other)], check=True, capture_output=True, timeout=60
        )
        c = Client(self.stack.address, tls=TlsConfig(ca=other / "ca.pem"), timeout=10, retries=1)
        self.addCleanup(c.close)
        with self.assertRaises(Unavailable) as ctx:
            c.apply(two_groups("untrusted", generation=1))
        self.assertNotIsInstance(ctx.exception, OutcomeUnknown)
        # Plaintext to a TLS port: the handshake never happens, so nothing was sent.
        plaintext = self.client(timeout=5, retries=0)
        with self.assertRaises(Unavailable) as ctx:
            plaintext.apply(two_groups("plaintext", generation=1))
        self.assertNotIsInstance(ctx.exception, OutcomeUnknown)


class RateLimitTest(StackTest):
    """A driver that allows 2 calls per 500 ms per client: reads wait as its
    retry hint says and go through; a change is never sent twice."""

    WINDOW_MS = 500
    DRIVER_ARGS = ["--allow-unauthenticated", "--rate-limit", "2", "--rate-limit-window-ms", str(WINDOW_MS)]

    def test_reads_wait_as_the_driver_asks(self):
        # One retry each: enough only if it waits out the window, as the
        # pushback says (a plain backoff retries within it, and fails).
        c = self.client(retries=1)
        time.sleep(self.WINDOW_MS / 1000)
        started = time.monotonic()
        for _ in range(4):
            c.providers()
        self.assertGreaterEqual(time.monotonic() - started, self.WINDOW_MS / 1000 * 0.9)

    def test_a_change_over_the_limit_is_refused_not_retried(self):
        c = self.client()
        time.sleep(self.WINDOW_MS / 1000 + 0.1)
        c.providers()
        c.providers()
        with self.assertRaises(ResourceExhausted) as ctx:
            c.apply(two_groups("limited", generation=1))
        # Two calls per 500 ms: one call's budget comes back every 250 ms,
        # and the hint is the time until the next one does.
        self.assertGreater(ctx.exception.retry_after, 0)
        self.assertLessEqual(ctx.exception.retry_after, self.WINDOW_MS / 2 / 1000)
        self.assertIn("--rate-limit", str(ctx.exception))
        with self.assertRaises(NotFound):
            c.get("limited")


if __name__ == "__main__":
    unittest.main()
