"""Every service's Prometheus endpoint, scraped from a running cluster: the figures move."""

import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import encode_chunks
from pstrain.runtime.identity import HEADER, MemberKeys
from pstrain.runtime.transport import open_channel
from tests.helpers import metrics_lines, wait_for


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_while_training(live_cluster):
    ps = [m.metrics_address for m in live_cluster.members("ps")]
    workers = [m.metrics_address for m in live_cluster.members("worker")]
    coordinator = live_cluster.status.metrics_address
    assert all(ps) and all(workers) and coordinator
    before = {a: scrape(a) for a in [*ps, *workers, coordinator]}
    seen = metrics_lines(live_cluster.out)
    wait_for(lambda: metrics_lines(live_cluster.out) >= seen + 3, 60, "three more steps")
    # A worker counts a step once its new parameters have all arrived, which with overlapped pulls is during
    # the next forward: its gauge may trail the coordinator's record by a step for a moment.
    wait_for(
        lambda: all(
            value(scrape(a), "pstrain_worker_step") >= value(before[a], "pstrain_worker_step") + 3 for a in workers
        ),
        60,
        "three more steps on every worker",
    )
    after = {a: scrape(a) for a in [*ps, *workers, coordinator]}

    for a in ps:
        for name in (
            "pstrain_ps_pushed_bytes_total",
            "pstrain_ps_pulled_bytes_total",
            "pstrain_ps_version",
            "pstrain_ps_push_seconds_count",
            "pstrain_ps_pull_seconds_count",
            "pstrain_ps_update_seconds_count",
        ):
            assert value(after[a], name) > value(before[a], name), name
        # parameters, their published and spare copies, accumulator, momentum; plus, at the moment of the scrape,
        # any contribution held early for a lower-numbered worker (at most one per other worker)
        held = value(after[a], "pstrain_ps_shard_bytes")
        assert 37 * 4 * 5 <= held <= 37 * 4 * (5 + len(workers) - 1)
        assert value(after[a], "process_resident_memory_bytes") > 10e6
    for a in workers:
        assert value(after[a], "pstrain_worker_step") >= value(before[a], "pstrain_worker_step") + 3
        assert value(after[a], "pstrain_worker_pushed_bytes_total") > value(
            before[a], "pstrain_worker_pushed_bytes_total"
        )
        assert value(after[a], "pstrain_worker_samples_total") - value(before[a], "pstrain_worker_samples_total") >= 24
        assert value(after[a], "pstrain_worker_step_seconds_count") > value(
            before[a], "pstrain_worker_step_seconds_count"
        )
    assert (
        value(after[coordinator], "pstrain_coordinator_step")
        >= value(before[coordinator], "pstrain_coordinator_step") + 3
    )
    assert value(after[coordinator], "pstrain_coordinator_workers_alive") == 2
    assert value(after[coordinator], "pstrain_coordinator_ps_shards_alive") == 2
    assert value(after[coordinator], "pstrain_coordinator_data_shards", state="done") > 0


def malformed_push(member: pb.MemberStatus) -> list[pb.PushRequest]:
    """A push whose header announces 3 values where the shard holds 37 (INVALID_ARGUMENT once it is looked at)."""
    header = pb.PushHeader(shard_id=member.id, worker_id=0, step=0, device_count=1, dtype=pb.FLOAT32, numel=3)
    return [pb.PushRequest(header=header), *(pb.PushRequest(chunk=c) for c in encode_chunks(torch.ones(3)))]


def refused_push(member: pb.MemberStatus, metadata: list[tuple[str, str]] | None, code: str) -> None:
    """Send ``malformed_push``; it is refused with ``code``, and the shard counts exactly that refusal."""
    before = scrape(member.metrics_address)
    with open_channel(member.address) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.ParameterServerStub(channel).Push(iter(malformed_push(member)), metadata=metadata, timeout=10)
    assert err.value.code() == getattr(grpc.StatusCode, code)
    after = scrape(member.metrics_address)
    assert (
        value(after, "pstrain_rejected_requests_total", code=code)
        == value(before, "pstrain_rejected_requests_total", code=code) + 1
    )


def test_rejected_requests_are_counted_by_code(live_cluster):
    # Worker 0's own credential (minted from the job key the coordinator keeps in <out>/job.key): the
    # push passes the identity gate, and the shard refuses its payload.
    worker0 = MemberKeys((live_cluster.out / "job.key").read_bytes()).mint("worker", 0)
    refused_push(live_cluster.members("ps")[0], [(HEADER, worker0.encode())], "INVALID_ARGUMENT")


def test_a_malformed_push_without_a_credential_is_refused_before_its_payload(live_cluster):
    # Issue 8: who pushes comes first, so an unauthenticated caller learns nothing about its payload's validity.
    refused_push(live_cluster.members("ps")[0], None, "PERMISSION_DENIED")
