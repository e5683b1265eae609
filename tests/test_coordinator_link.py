"""The worker's calls to a coordinator that is going away, over a real gRPC server on port 0.

A coordinator stopping (SIGTERM) or restarting answers a call in flight with UNAVAILABLE or, when
the call reaches it as it stops, CANCELLED: both are retried; a refusal that says the request is
wrong is not. A retry repeats the request as it was (the data-shard request's ``request_seq``), and
a completion whose first reply was lost is known done when the retry finds the shard not held.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.runtime.lifecycle import Stopped
from pstrain.runtime.transport import open_channel, start_server
from pstrain.worker.coordinator_link import CoordinatorLink


class FlakyCoordinator(pb_grpc.CoordinatorServicer):
    """Refuses the first ``failures`` calls of each method with ``code``; records every request."""

    def __init__(self, code: grpc.StatusCode, failures: int, complete_first: bool = False) -> None:
        self.code, self.failures = code, failures
        self.complete_first = complete_first  # CompleteDataShard: done before the "lost" reply
        self.calls: dict[str, list[object]] = {}
        self.held = {7}

    def _answer(self, method: str, request: object, context: grpc.ServicerContext) -> None:
        calls = self.calls.setdefault(method, [])
        calls.append(request)
        if len(calls) <= self.failures:
            context.abort(self.code, f"refused try {len(calls)}")

    def RequestDataShard(self, request, context):
        self._answer("RequestDataShard", request, context)
        return pb.DataShard(data_shard_id=request.request_seq * 10)

    def CompleteDataShard(self, request, context):
        if self.complete_first and request.data_shard_id in self.held:
            self.held.discard(request.data_shard_id)
            self.calls.setdefault("CompleteDataShard", []).append(request)
            context.abort(self.code, "the reply is lost as the coordinator stops")
        if request.data_shard_id not in self.held:
            context.abort(grpc.StatusCode.NOT_FOUND, f"data shard {request.data_shard_id} is not held")
        self._answer("CompleteDataShard", request, context)
        self.held.discard(request.data_shard_id)
        return pb.Empty()

    def ReportStep(self, request, context):
        self._answer("ReportStep", request, context)
        return pb.Directive(stop=False, state=pb.RUNNING)


@pytest.fixture
def coordinator():
    made = []

    def start(servicer: FlakyCoordinator) -> CoordinatorLink:
        server = start_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, servicer)], [])
        channel = open_channel(f"127.0.0.1:{server.port}")
        made.append((server, channel))
        return CoordinatorLink(channel, worker_id=1, patience_s=30.0)

    yield start
    for server, channel in made:
        channel.close()
        server.stop(0)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_calls_to_a_coordinator_that_is_going_away_are_repeated_as_they_were(coordinator, code):
    servicer = FlakyCoordinator(code, failures=2)
    link = coordinator(servicer)
    shard = link.request()
    assert shard.data_shard_id == 10  # the first request's number, repeated by each retry
    assert [r.request_seq for r in servicer.calls["RequestDataShard"]] == [1, 1, 1]
    assert link.report(pb.StepReport(worker_id=1, step=4)).stop is False
    assert [r.step for r in servicer.calls["ReportStep"]] == [4, 4, 4]
    assert link.request().data_shard_id == 20  # a new request gets the next number


def test_a_completion_whose_reply_was_lost_is_known_done(coordinator):
    servicer = FlakyCoordinator(grpc.StatusCode.CANCELLED, failures=0, complete_first=True)
    link = coordinator(servicer)
    link.complete(7)  # the retry finds data shard 7 completed by the first try: no error
    assert servicer.held == set()
    with pytest.raises(grpc.RpcError) as unknown:
        link.complete(8)  # never held: a first try refused with NOT_FOUND is an error
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_refusal_that_names_a_wrong_request_is_not_repeated(coordinator):
    servicer = FlakyCoordinator(grpc.StatusCode.INVALID_ARGUMENT, failures=1)
    link = coordinator(servicer)
    with pytest.raises(grpc.RpcError) as refused:
        link.report(pb.StepReport(worker_id=1, step=4))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(servicer.calls["ReportStep"]) == 1


class WaitingCoordinator(pb_grpc.CoordinatorServicer):
    """WaitForCluster waits until the caller is gone (PS shards that never come), recording that it left."""

    def __init__(self) -> None:
        self.waiting, self.left = threading.Event(), threading.Event()

    def WaitForCluster(self, request, context):
        self.waiting.set()
        while context.is_active():
            self.left.wait(0.05)
        self.left.set()
        context.abort(grpc.StatusCode.CANCELLED, "the caller is gone")


def test_a_stop_cancels_the_wait_for_the_cluster_at_once(coordinator):
    """SIGTERM while a worker waits for slow PS shards (up to --cluster-timeout-s, 600 s): the call is
    cancelled and the worker stops (``Stopped``: exit 0), instead of waiting out the call's deadline."""
    servicer = WaitingCoordinator()
    link = coordinator(servicer)
    link.stop = threading.Event()
    signalled = threading.Thread(target=lambda: servicer.waiting.wait(10) and link.stop.set())
    signalled.start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        link.wait_for_cluster(20.0)
    signalled.join()
    assert time.monotonic() - started < 5.0
    assert servicer.left.wait(5.0), "the coordinator saw the call cancelled"
