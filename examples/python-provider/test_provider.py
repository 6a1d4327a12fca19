"""Tests of the example provider plugin over real gRPC.

Each test starts ``provider.py`` as a subprocess (with ``--testing`` and a
state file in a temporary directory), reads its announcement line, talks to
it through the generated stubs, and stops that process (by its handle) with
SIGTERM, checking that it exits 0.

Run from the repository root::

    python3 -m unittest discover -s examples/python-provider -v
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid
from pathlib import Path
from typing import Callable, Optional

import grpc

import protos

pb, pb_grpc = protos.load()

PROVIDER = Path(__file__).resolve().parent / "provider.py"
TIMEOUT_S = 10.0


class Plugin:
    """One running ``provider.py`` process and a channel to it."""

    def __init__(self, workdir: Path, *args: str):
        self.stderr_path = workdir / f"provider-{uuid.uuid4().hex[:8]}.log"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PROVIDER), *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.address = self._read_announcement()
        self.channel = grpc.insecure_channel(self.address)
        self.provider = pb_grpc.ProviderStub(self.channel)
        self.testing = pb_grpc.ProviderTestingStub(self.channel)

    def _read_announcement(self) -> str:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=TIMEOUT_S)
        except queue.Empty:
            line = ""
        prefix = "provider-listening "
        if not line.startswith(prefix):
            self.stop()
            raise AssertionError(f"no announcement (got {line!r}); stderr:\n{self.stderr_path.read_text()}")
        return line[len(prefix):].strip()

    def stop(self) -> int:
        """Sends SIGTERM to this process, waits for it, returns its exit code."""
        if hasattr(self, "channel"):
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                # Why it did not stop is in its log: keep it with the failure.
                self._stderr.flush()
                print(f"plugin {self.proc.pid} ignored SIGTERM for {TIMEOUT_S} s; its stderr:\n"
                      f"{self.stderr_path.read_text()}", file=sys.stderr)
        self.proc.stdout.close()
        self._stderr.close()
        return self.proc.returncode


class Watcher:
    """A Watch stream read on a background thread into a queue."""

    def __init__(self, stub):
        self._stream = stub.Watch(pb.WatchRequest())
        self._events: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                self._events.put(event)
        except grpc.RpcError:
            pass  # cancelled by close(), or the plugin stopped

    def next(self, timeout: float = TIMEOUT_S) -> "pb.WatchEvent":
        return self._events.get(timeout=timeout)

    def wait_for(self, matches: Callable[["pb.WatchEvent"], bool], timeout: float = TIMEOUT_S) -> "pb.WatchEvent":
        """The first event (from now on) that ``matches``; fails after ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError("no matching Watch event in time")
            try:
                event = self._events.get(timeout=remaining)
            except queue.Empty:
                continue
            if matches(event):
                return event

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(timeout=TIMEOUT_S)


def new_identity() -> "pb.Identity":
    return pb.Identity(run_uid=uuid.uuid4().hex, run_id="run-1", node_id="node-a", attempt=1)


def call(identity: "pb.Identity", deadline_unix_ms: int = 0) -> "pb.Call":
    if not deadline_unix_ms:
        deadline_unix_ms = int(time.time() * 1000) + 30_000
    return pb.Call(
        identity=identity,
        operation_id=uuid.uuid4().hex,
        deadline_unix_ms=deadline_unix_ms,
        provider_name="python-example",
    )


def outcome(response) -> str:
    """The name of the answer's outcome (``succeeded``, ``failed``, ...)."""
    return response.answer.WhichOneof("outcome") or "ambiguous"


def is_stage(identity, stage=None):
    return lambda e: e.WhichOneof("event") == "stage" and e.stage.identity == identity and (
        stage is None or e.stage.stage == stage
    )


def is_health(identity, healthy=None):
    return lambda e: e.WhichOneof("event") == "health" and e.health.identity == identity and (
        healthy is None or e.health.healthy == healthy
    )


def accepts_connections(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except ConnectionRefusedError:
        return False


class ProviderTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="python-provider-test-")
        self.workdir = Path(self._tmp.name)
        self.state_file = self.workdir / "state.json"
        self.plugin = self.start_plugin()

    def tearDown(self):
        if self.plugin is not None:
            self.assertEqual(self.plugin.stop(), 0, "the plugin exits 0 on SIGTERM")
        self._tmp.cleanup()

    def start_plugin(self) -> Plugin:
        return Plugin(self.workdir, "--testing", "--state-file", str(self.state_file), "--stage-interval-ms", "20")

    @property
    def stub(self):
        return self.plugin.provider

    def watch(self) -> Watcher:
        watcher = Watcher(self.stub)
        self.addCleanup(watcher.close)
        return watcher

    def create(self, identity, image: str = "debian-12") -> "pb.CreateLeaseResponse":
        return self.stub.CreateLease(
            pb.CreateLeaseRequest(call=call(identity), template=pb.Template(role="worker", image=image))
        )

    def listed(self) -> dict:
        """Listed resources by identity run_uid."""
        return {r.identity.run_uid: r for r in self.stub.ListResources(pb.ListResourcesRequest()).resources}

    def bound_endpoint(self, identity, lease_id: str) -> str:
        """Looks the endpoint up: NotReady first, then Succeeded."""
        request = pb.LookupEndpointRequest(call=call(identity), lease_id=lease_id)
        self.assertEqual(outcome(self.stub.LookupEndpoint(request)), "not_ready")
        answer = self.stub.LookupEndpoint(request)
        self.assertEqual(outcome(answer), "succeeded", answer)
        return answer.endpoint

    # -- the tests --------------------------------------------------------

    def test_get_info(self):
        info = self.stub.GetInfo(pb.GetInfoRequest())
        self.assertEqual(info.protocol_version, pb.PROTOCOL_VERSION_1)
        self.assertEqual(list(info.provider_names), ["python-example"])
        self.assertTrue(info.capabilities.reports_health)
        self.assertTrue(info.capabilities.reports_loss)
        self.assertTrue(info.description)

    def test_create_twice_is_one_resource(self):
        identity = new_identity()
        first, second = self.create(identity), self.create(identity)
        self.assertEqual(outcome(first), "succeeded")
        self.assertEqual(outcome(second), "succeeded")
        self.assertTrue(first.lease_id.startswith("py-"))
        self.assertEqual(first.lease_id, second.lease_id)
        listed = self.listed()
        self.assertEqual(len(listed), 1)
        self.assertEqual(listed[identity.run_uid].lease_id, first.lease_id)
        self.assertEqual(listed[identity.run_uid].provider_name, "python-example")

    def test_invalid_identity_is_a_permanent_failure(self):
        identity = new_identity()
        identity.node_id = ""
        answer = self.create(identity)
        self.assertEqual(outcome(answer), "failed")
        self.assertEqual(answer.answer.failed.kind, pb.FAILURE_KIND_PERMANENT)
        self.assertIn("node_id", answer.answer.failed.reason)
        no_image = self.create(new_identity(), image="")
        self.assertEqual(no_image.answer.failed.kind, pb.FAILURE_KIND_PERMANENT)
        self.assertIn("template.image", no_image.answer.failed.reason)
        self.assertEqual(self.listed(), {})

    def test_lookup_not_ready_then_endpoint_accepts(self):
        identity = new_identity()
        lease = self.create(identity).lease_id
        self.assertEqual(self.listed()[identity.run_uid].endpoint, "", "not bound before a lookup")
        endpoint = self.bound_endpoint(identity, lease)
        self.assertTrue(endpoint.startswith("127.0.0.1:"))
        self.assertTrue(accepts_connections(endpoint))
        self.assertEqual(self.listed()[identity.run_uid].endpoint, endpoint)

    def test_lookup_of_unknown_identity_or_other_lease_fails(self):
        answer = self.stub.LookupEndpoint(pb.LookupEndpointRequest(call=call(new_identity()), lease_id="py-x"))
        self.assertEqual(answer.answer.failed.kind, pb.FAILURE_KIND_PERMANENT)
        identity = new_identity()
        self.create(identity)
        answer = self.stub.LookupEndpoint(pb.LookupEndpointRequest(call=call(identity), lease_id="py-other"))
        self.assertEqual(answer.answer.failed.kind, pb.FAILURE_KIND_PERMANENT)

    def test_bootstrap_stages_and_watch_replay(self):
        identity = new_identity()
        lease = self.create(identity).lease_id
        endpoint = self.bound_endpoint(identity, lease)
        watcher = self.watch()
        watcher.wait_for(is_health(identity))  # the stream is open on the plugin's side

        start = pb.StartBootstrapRequest(call=call(identity), lease_id=lease, endpoint=endpoint)
        started = self.stub.StartBootstrap(start)
        self.assertEqual(outcome(started), "succeeded")
        self.assertTrue(started.session_id.startswith("py-s-"))

        stages = []
        while not stages or stages[-1] != pb.STAGE_CONVERGED:
            event = watcher.wait_for(is_stage(identity))
            self.assertEqual(event.stage.session_id, started.session_id)
            stages.append(event.stage.stage)
        self.assertEqual(
            stages,
            [pb.STAGE_CONNECTED, pb.STAGE_BOOT_CHECK, pb.STAGE_AGENT_STARTED, pb.STAGE_JOINED, pb.STAGE_CONVERGED],
        )

        # A retry adopts the live session.
        self.assertEqual(self.stub.StartBootstrap(start).session_id, started.session_id)
        self.assertTrue(self.listed()[identity.run_uid].session_live)

        # A stream opened now first gets the session's latest stage.
        first = self.watch().next()
        self.assertTrue(is_stage(identity, pb.STAGE_CONVERGED)(first), first)
        self.assertEqual(first.stage.session_id, started.session_id)

        cancel = pb.CancelBootstrapRequest(call=call(identity), session_id=started.session_id)
        self.assertEqual(outcome(self.stub.CancelBootstrap(cancel)), "succeeded")
        self.assertEqual(outcome(self.stub.CancelBootstrap(cancel)), "succeeded", "absent is success")
        self.assertFalse(self.listed()[identity.run_uid].session_live)

    def test_bootstrap_fail_at(self):
        identity = new_identity()
        lease = self.create(identity).lease_id
        watcher = self.watch()
        watcher.wait_for(is_health(identity))
        boot = {"fail_at": pb.Param(value="joined")}
        started = self.stub.StartBootstrap(pb.StartBootstrapRequest(call=call(identity), lease_id=lease, boot=boot))
        self.assertEqual(outcome(started), "succeeded")
        watcher.wait_for(is_stage(identity, pb.STAGE_FAILED_JOIN))

    def test_bootstrap_without_lease_is_retryable(self):
        request = pb.StartBootstrapRequest(call=call(new_identity()), lease_id="py-unknown")
        answer = self.stub.StartBootstrap(request)
        self.assertEqual(outcome(answer), "failed")
        self.assertEqual(answer.answer.failed.kind, pb.FAILURE_KIND_RETRYABLE)

    def test_destroy_of_absent_succeeds(self):
        never_seen = pb.DestroyLeaseRequest(call=call(new_identity()))
        self.assertEqual(outcome(self.stub.DestroyLease(never_seen)), "succeeded")

        identity = new_identity()
        lease = self.create(identity).lease_id
        destroy = pb.DestroyLeaseRequest(call=call(identity), lease_id=lease)
        self.assertEqual(outcome(self.stub.DestroyLease(destroy)), "succeeded")
        self.assertEqual(outcome(self.stub.DestroyLease(destroy)), "succeeded", "absent is success")
        self.assertEqual(outcome(self.stub.DestroyLease(pb.DestroyLeaseRequest(call=call(identity)))), "succeeded")
        self.assertEqual(self.listed(), {})

    def test_list_agrees_with_what_exists(self):
        kept, destroyed = new_identity(), new_identity()
        kept_lease = self.create(kept).lease_id
        self.create(destroyed)
        self.assertEqual(set(self.listed()), {kept.run_uid, destroyed.run_uid})
        self.stub.DestroyLease(pb.DestroyLeaseRequest(call=call(destroyed)))
        listed = self.listed()
        self.assertEqual(set(listed), {kept.run_uid})
        self.assertEqual(listed[kept.run_uid].identity, kept)
        self.assertEqual(listed[kept.run_uid].lease_id, kept_lease)
        self.assertFalse(listed[kept.run_uid].session_live)

    def test_pages_list_what_the_one_message_lists(self):
        for _ in range(3):
            self.create(new_identity())
        pages = list(self.stub.ListResourcePages(pb.ListResourcePagesRequest()))
        self.assertTrue(pages)
        self.assertEqual([p.last for p in pages], [False] * (len(pages) - 1) + [True])
        paged = [r for p in pages for r in p.resources]
        whole = list(self.stub.ListResources(pb.ListResourcesRequest()).resources)
        self.assertEqual(paged, whole)

    def test_restart_keeps_resources(self):
        identity = new_identity()
        lease = self.create(identity).lease_id
        endpoint = self.bound_endpoint(identity, lease)

        self.assertEqual(self.plugin.stop(), 0)
        self.plugin = self.start_plugin()

        listed = self.listed()
        self.assertEqual(set(listed), {identity.run_uid})
        self.assertEqual(listed[identity.run_uid].lease_id, lease)
        self.assertEqual(outcome(self.create(identity)), "succeeded")
        self.assertEqual(self.create(identity).lease_id, lease, "a create after the restart adopts")
        answer = self.stub.LookupEndpoint(pb.LookupEndpointRequest(call=call(identity), lease_id=lease))
        self.assertEqual(outcome(answer), "succeeded")
        self.assertTrue(accepts_connections(answer.endpoint))
        if answer.endpoint != endpoint:
            print(f"(the port was taken: {endpoint} moved to {answer.endpoint})", file=sys.stderr)

    def test_lose_reports_lost(self):
        identity = new_identity()
        self.create(identity)
        watcher = self.watch()
        watcher.wait_for(is_health(identity))
        self.assertTrue(self.plugin.testing.Lose(pb.LoseRequest(identity=identity)).found)
        event = watcher.wait_for(lambda e: e.WhichOneof("event") == "lost")
        self.assertEqual(event.lost.identity, identity)
        self.assertEqual(self.listed(), {})
        self.assertFalse(self.plugin.testing.Lose(pb.LoseRequest(identity=identity)).found)

    def test_set_unhealthy_closes_the_endpoint(self):
        identity = new_identity()
        lease = self.create(identity).lease_id
        endpoint = self.bound_endpoint(identity, lease)
        watcher = self.watch()
        watcher.wait_for(is_health(identity, True))

        found = self.plugin.testing.SetHealthy(pb.SetHealthyRequest(identity=identity, healthy=False)).found
        self.assertTrue(found)
        watcher.wait_for(is_health(identity, False))
        self.assertFalse(accepts_connections(endpoint))

        self.plugin.testing.SetHealthy(pb.SetHealthyRequest(identity=identity, healthy=True))
        watcher.wait_for(is_health(identity, True))
        answer = self.stub.LookupEndpoint(pb.LookupEndpointRequest(call=call(identity), lease_id=lease))
        self.assertTrue(accepts_connections(answer.endpoint))

    def test_bad_image_is_a_permanent_failure(self):
        answer = self.create(new_identity(), image="bad:no-such-image")
        self.assertEqual(outcome(answer), "failed")
        self.assertEqual(answer.answer.failed.kind, pb.FAILURE_KIND_PERMANENT)
        self.assertEqual(answer.lease_id, "")
        self.assertEqual(self.listed(), {})

    def test_past_deadline_is_ambiguous(self):
        past = int(time.time() * 1000) - 1_000
        request = pb.CreateLeaseRequest(call=call(new_identity(), deadline_unix_ms=past))
        self.assertEqual(outcome(self.stub.CreateLease(request)), "ambiguous")
        self.assertEqual(self.listed(), {})

    def test_unexpected_error_is_ambiguous_and_undone(self):
        # The state file's directory disappears: persisting the new resource
        # raises, so the plugin cannot know it kept it. It answers Ambiguous
        # and undoes the create.
        self.assertEqual(self.plugin.stop(), 0)
        gone = self.workdir / "gone"
        gone.mkdir()
        self.plugin = Plugin(self.workdir, "--state-file", str(gone / "state.json"))
        gone.rmdir()
        self.assertEqual(outcome(self.create(new_identity())), "ambiguous")
        self.assertEqual(self.listed(), {})


class UnixSocketTest(unittest.TestCase):
    def test_listens_on_a_unix_socket(self):
        with tempfile.TemporaryDirectory(prefix="python-provider-test-") as tmp:
            path = Path(tmp) / "provider.sock"
            plugin = Plugin(Path(tmp), "--listen", f"unix:{path}")
            try:
                self.assertEqual(plugin.address, f"unix:{path}")
                info = plugin.provider.GetInfo(pb.GetInfoRequest())
                self.assertEqual(info.protocol_version, pb.PROTOCOL_VERSION_1)
            finally:
                self.assertEqual(plugin.stop(), 0)


if __name__ == "__main__":
    unittest.main()
