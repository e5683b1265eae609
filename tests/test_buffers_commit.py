"""Issue 11: the workers' buffers gate the commit of a checkpoint, are written with it and come back on resume.

Plain objects first (the store, the ledger, the job), then the wire (a real coordinator servicer on
port 0 and the worker's ``CoordinatorLink``), then the worker's side (``SlotBufferCheckpoints`` over
real CPU replicas).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from pstrain.coordinator.buffer_store import BufferStore, buffer_files, part_files, slot_names
from pstrain.coordinator.checkpoints import CheckpointLedger, Manifest, committed_steps, discard
from pstrain.coordinator.config import parse_config
from pstrain.coordinator.data_shards import DataShardTracker
from pstrain.coordinator.errors import InvalidRequest, WrongState
from pstrain.coordinator.job import Job
from pstrain.coordinator.journal import JOURNAL_NAME, JournalUnusable, recovery
from pstrain.coordinator.ledger import StepReport
from pstrain.coordinator.model_state import ModelState
from pstrain.coordinator.plan import job_spec, make_plan
from pstrain.coordinator.service import CoordinatorServicer
from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.protos.codec import encode_named_tensors
from pstrain.runtime.layout import ParamLayout
from pstrain.runtime.transport import open_channel, start_server
from pstrain.worker.coordinator_link import CoordinatorLink
from pstrain.worker.replicas import ReplicaSet
from pstrain.worker.slot_buffers import SlotBufferCheckpoints
from tests.helpers import bn_mlp, classification_set, odd_mlp

WORKERS, REPLICAS = 2, 2


def slot(seed: float, model=bn_mlp) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """A slot's buffers with recognisable values: every replica's, as a worker uploads them."""
    out = {}
    for name, b in slot_names(model(), REPLICAS).items():
        out[name] = torch.full_like(b, int(seed)) if b.dtype == torch.int64 else torch.full_like(b, seed)
    return out


def template(shards: int = 2) -> Manifest:
    return Manifest(
        step=-1,
        job_hash="abc",
        ps_shards=shards,
        total_params=10,
        workers=WORKERS,
        per_worker_batch=8,
        committed_unix_s=0,
    )


def test_no_commit_without_every_slots_buffers_when_the_model_has_buffers(tmp_path):
    ledger = CheckpointLedger(tmp_path, template(), keep=2)
    store = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    ledger.buffers = store
    for shard in range(2):
        ledger.confirm(shard, 3)
    assert ledger.commit(completed_steps=3) is None  # every shard confirmed, the step recorded: no buffers yet
    store.put(0, 3, slot(1.0))
    assert ledger.commit(completed_steps=3) is None and committed_steps(tmp_path) == []  # slot 1's are missing
    store.put(1, 3, slot(2.0))
    manifest = ledger.commit(completed_steps=3)
    assert manifest is not None and manifest.step == 3
    assert buffer_files(tmp_path) == committed_steps(tmp_path) == [3]  # written with (before) the manifest

    resumed = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    assert resumed.load(tmp_path, 3)
    for worker_id, value in ((0, 1.0), (1, 2.0)):
        found = resumed.newest(worker_id, 3)
        assert found is not None and found[0] == 3
        for name, tensor in slot(value).items():
            assert torch.equal(found[1][name], tensor) and found[1][name].dtype == tensor.dtype

    for step in (6, 9):  # pruned with the manifests (keep 2); discard takes them all
        for shard in range(2):
            ledger.confirm(shard, step)
        store.put(0, step, slot(1.0))
        store.put(1, step, slot(2.0))
        assert ledger.commit(completed_steps=step) is not None
    assert buffer_files(tmp_path) == committed_steps(tmp_path) == [6, 9]
    assert store.newest(0, 100)[0] == 9  # type: ignore[index]
    assert store.newest(0, 8) is None  # in memory: the newest committed step's (for a replacement) and later ones
    discard(tmp_path)
    assert buffer_files(tmp_path) == committed_steps(tmp_path) == []


def test_a_model_without_buffers_commits_without_uploads_and_writes_no_buffers_file(tmp_path):
    ledger = CheckpointLedger(tmp_path, template(), keep=2)
    store = BufferStore(odd_mlp(), WORKERS, REPLICAS)
    ledger.buffers = store
    assert not store.needed and store.expected() == {}
    for shard in range(2):
        ledger.confirm(shard, 3)
    assert ledger.commit(completed_steps=3) is not None
    assert committed_steps(tmp_path) == [3] and buffer_files(tmp_path) == []
    assert not BufferStore(odd_mlp(), WORKERS, REPLICAS).load(tmp_path, 3)


def test_the_store_refuses_incomplete_or_misshapen_buffers_and_unknown_slots(tmp_path):
    store = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    partial = slot(1.0)
    del partial["1/1.running_var"]
    with pytest.raises(InvalidRequest, match="incomplete"):
        store.put(0, 3, partial)
    wrong = {**slot(1.0), "0/1.running_mean": torch.zeros(7)}
    with pytest.raises(InvalidRequest, match="running_mean"):
        store.put(0, 3, wrong)
    with pytest.raises(InvalidRequest, match="out of range"):
        store.put(2, 3, slot(1.0))
    assert not store.complete(3) and store.newest(0, 3) is None


RAW = {
    "model": {"factory": "tests.helpers:bn_mlp"},
    "data": {"factory": "tests.helpers:classification_set", "shard_size": 8},
    "job": {"steps": 6, "seed": 0},
    "batch": {"per_device": 4},
    "cluster": {"ps_shards": 3, "workers": WORKERS, "devices_per_worker": REPLICAS},
    "checkpoint": {"every_steps": 3},
}


def make_job(tmp_path, start_step: int = 0, taken_back=None, raw=RAW) -> Job:  # type: ignore[no-untyped-def]
    cfg = parse_config(raw)
    plan = make_plan(cfg)
    model = ModelState(cfg)
    spec = job_spec(cfg, plan, model.layout, "bn-job", checkpoint_dir=str(tmp_path / "ckpt"))
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    manifest = Manifest(-1, "abc", 3, model.layout.total, WORKERS, 8, 0.0)
    ledger = CheckpointLedger(tmp_path / "ckpt", manifest, keep=2)
    tracker = DataShardTracker(16, 8, True, 0, slots=WORKERS)
    if start_step:
        tracker.resume(start_step, 8)
    zeros = torch.zeros(model.layout.total)
    return Job(
        "bn-job",
        plan,
        spec,
        model,
        tracker,
        tmp_path,
        lambda a, v: zeros,
        30.0,
        start_step=start_step,
        checkpoints=ledger,
        recovery=taken_back,
    )


def start(job: Job) -> None:
    for i in range(3):
        job.register_ps(i, f"127.0.0.1:{5000 + i}")
        job.ps_ready(i)
    for i in range(WORKERS):
        job.register_worker(f"127.0.0.1:{6000 + i}", [], "h")


def test_the_job_commits_a_checkpoint_with_the_last_slots_buffers_and_a_resumed_job_serves_them(tmp_path):
    job = make_job(tmp_path)
    start(job)
    for step in range(3):
        for worker in range(WORKERS):
            job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=8, step_s=0.1))
    for shard in range(3):
        job.checkpoint_written(shard, 3)
    assert job.checkpoint_step == -1  # shards and records are there; the buffers are not
    with pytest.raises(InvalidRequest, match="not a checkpoint step"):
        job.checkpoint_buffers(0, 2, slot(1.0))
    job.checkpoint_buffers(0, 3, slot(1.0))
    assert job.checkpoint_step == -1
    assert job.slot_buffers(1, 3) is None and job.slot_buffers(0, 3)[0] == 3  # type: ignore[index]
    job.checkpoint_buffers(1, 3, slot(2.0))
    assert job.checkpoint_step == 3
    job.checkpoint_buffers(1, 3, slot(2.0))  # repeated after the commit (a replacement redid it): taken, ignored
    job.close()

    resumed = make_job(tmp_path, start_step=3)  # a rollback / restart: the buffers come back from the file
    start(resumed)
    found = resumed.slot_buffers(1, 3)
    assert (
        found is not None and found[0] == 3 and torch.equal(found[1]["1/1.running_mean"], slot(2.0)["1/1.running_mean"])
    )
    resumed.close()


def test_buffers_travel_both_ways_over_grpc_checked_before_allocation(tmp_path):
    job = make_job(tmp_path)
    start(job)
    server = start_server(
        "127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job))], ["Coordinator"]
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    try:
        link = CoordinatorLink(channel, worker_id=1)
        link.upload_slot_buffers(3, slot(5.0), chunk_bytes=8)  # several chunks per tensor
        step, got = link.fetch_slot_buffers(4, job.buffers.expected())  # the newest at or before 4
        assert step == 3 and set(got) == set(slot(5.0))
        assert all(torch.equal(got[n], t) for n, t in slot(5.0).items())
        assert link.fetch_slot_buffers(2, job.buffers.expected()) == (-1, {})  # nothing at or before 2

        huge = pb.TensorChunk(name="0/1.running_mean", dtype=pb.FLOAT32, shape=[1 << 40], offset=0, data=b"")
        parts = [pb.SlotBuffersPart(header=pb.SlotBuffersHeader(worker_id=1, step=6)), pb.SlotBuffersPart(chunk=huge)]
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.CoordinatorStub(channel).UploadSlotBuffers(iter(parts), timeout=10)
        assert (
            refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "expected FLOAT32 (6,)" in refused.value.details()
        )
        with pytest.raises(grpc.RpcError) as headless:
            pb_grpc.CoordinatorStub(channel).UploadSlotBuffers(iter(parts[1:]), timeout=10)
        assert headless.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
        server.stop(0)
        job.close()


def final_buffers(value: float) -> dict[str, torch.Tensor]:
    """Worker 0's final buffers as it uploads them for model.pt: the model's own names, one replica."""
    return {n: torch.full_like(b, int(value) if b.dtype == torch.int64 else value) for n, b in bn_mlp().named_buffers()}


def test_final_buffers_that_miss_some_of_the_models_are_refused_and_keep_nothing(tmp_path):
    """A partial UploadBuffers was kept: model.pt then mixed trained statistics with initial ones, an empty one
    ended the export's wait for buffers, and either replaced a whole upload kept before."""
    job = make_job(tmp_path)
    start(job)
    server = start_server(
        "127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(job))], ["Coordinator"]
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.CoordinatorStub(channel)
    whole = final_buffers(3.0)
    partial = {"1.running_mean": whole["1.running_mean"]}
    try:
        for upload in (partial, {}):
            with pytest.raises(grpc.RpcError) as refused:
                stub.UploadBuffers(encode_named_tensors(upload, 16), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            missing = sorted(set(whole) - set(upload))
            assert f"missing {missing}" in refused.value.details()
            assert "nothing was kept" in refused.value.details()
            assert job.export._buffers is None  # the export still waits for worker 0's buffers
        stub.UploadBuffers(encode_named_tensors(whole, 16), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:  # a partial one later leaves the whole one as it was
            stub.UploadBuffers(encode_named_tensors({"1.running_var": torch.zeros(6)}, 16), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert set(job.export._buffers) == set(whole)
        assert all(torch.equal(job.export._buffers[n], t) for n, t in whole.items())
    finally:
        channel.close()
        server.stop(0)
        job.close()


def test_slot_buffers_with_a_name_the_model_lacks_are_refused_naming_it():
    store = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    extra = {**slot(1.0), "2/1.running_mean": torch.zeros(6)}  # a third replica the job does not have
    with pytest.raises(InvalidRequest, match=r"unknown \['2/1.running_mean'\]"):
        store.put(0, 3, extra)
    assert store.newest(0, 3) is None


class FakeLink:
    """The coordinator's two buffer calls, in memory."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, torch.Tensor]] = {}

    def upload_slot_buffers(self, step: int, buffers: dict[str, torch.Tensor], chunk_bytes: int) -> None:
        self.held[step] = buffers

    def fetch_slot_buffers(self, step, expected):  # type: ignore[no-untyped-def]
        steps = [s for s in self.held if s <= step]
        return (max(steps), self.held[max(steps)]) if steps else (-1, {})


def replicas() -> ReplicaSet:
    torch.manual_seed(0)
    return ReplicaSet(bn_mlp, [torch.device("cpu")] * REPLICAS, ParamLayout.of(bn_mlp()))


def spec(every: int = 3) -> pb.JobSpec:
    return pb.JobSpec(steps=7, checkpoint_every_steps=every, checkpoint_dir="/ckpt", chunk_bytes=1 << 20)


def train_forward(rs: ReplicaSet, seed: int) -> None:
    inputs, _ = classification_set(16, seed=seed).tensors
    rs.train()
    with torch.no_grad():
        for r, x in zip(rs.replicas, inputs.chunk(REPLICAS), strict=True):
            r.model(x)


def test_the_worker_uploads_at_checkpoint_steps_and_a_resumed_slot_gets_every_replicas_buffers_back():
    link = FakeLink()
    worker = replicas()
    checkpoints = SlotBufferCheckpoints.of(link, worker, spec())
    assert checkpoints is not None
    for step in range(7):
        train_forward(worker, seed=step)
        checkpoints.after_step(step)
    assert sorted(link.held) == [3, 6, 7]  # every 3 versions and the last
    assert not torch.equal(link.held[7]["0/1.running_mean"], link.held[7]["1/1.running_mean"])  # replicas differ
    assert int(link.held[6]["1/1.num_batches_tracked"]) == 6

    resumed = replicas()
    again = SlotBufferCheckpoints(link, resumed, spec())
    again.restore(6)
    assert again.exact
    for name, tensor in resumed.slot_buffers().items():
        assert torch.equal(tensor, link.held[6][name])
    train_forward(resumed, seed=6)  # the same forward as the uninterrupted worker's step 6
    assert all(torch.equal(t, link.held[7][n]) for n, t in resumed.slot_buffers().items())

    late = SlotBufferCheckpoints(link, replicas(), spec())
    late.restore(5)  # a replacement past its slot's checkpoint 3: that one's, not exact
    assert not late.exact

    assert SlotBufferCheckpoints.of(link, worker, spec(every=0)) is None  # no checkpoints: nothing to keep
    plain = ReplicaSet(odd_mlp, [torch.device("cpu")], ParamLayout.of(odd_mlp()))
    assert SlotBufferCheckpoints.of(link, plain, spec()) is None  # no buffers: nothing is uploaded


def test_an_upload_from_a_worker_declared_failed_is_refused(tmp_path):
    job = make_job(tmp_path)
    job.replace_timeout_s = 60.0
    start(job)
    with job._cond:
        job._vacate(1, "test")
    with pytest.raises(WrongState, match="declared failed"):
        job.checkpoint_buffers(1, 3, slot(1.0))
    job.close()


def test_uploads_not_yet_committed_survive_a_restart_of_the_store(tmp_path):
    first = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    first.spool(tmp_path, recovered_from=-1)
    first.put(0, 3, slot(1.0))
    first.put(1, 3, slot(2.0))
    first.put(0, 6, slot(3.0))
    assert part_files(tmp_path) == [(3, 0), (3, 1), (6, 0)]

    taken_back = BufferStore(bn_mlp(), WORKERS, REPLICAS)  # the coordinator restarted: its memory is gone
    taken_back.spool(tmp_path, recovered_from=-1)
    assert taken_back.complete(3) and not taken_back.complete(6)
    assert all(torch.equal(taken_back.newest(1, 3)[1][n], t) for n, t in slot(2.0).items())  # type: ignore[index]
    ledger = CheckpointLedger(tmp_path, template(), keep=2)
    ledger.buffers = taken_back
    for shard in range(2):
        ledger.confirm(shard, 3)
    assert ledger.commit(completed_steps=3) is not None and buffer_files(tmp_path) == [3]
    assert part_files(tmp_path) == [(6, 0)]  # pruned at and below the commit, after the manifest

    again = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    again.spool(tmp_path, recovered_from=3)  # restarted once more: only what the commit did not take
    assert again.newest(0, 6)[0] == 6 and again.newest(1, 6) is None  # type: ignore[index]
    BufferStore(bn_mlp(), WORKERS, REPLICAS).spool(tmp_path, recovered_from=None)  # a job started anew
    assert part_files(tmp_path) == []


def test_an_unreadable_upload_part_makes_the_journal_unusable(tmp_path):
    store = BufferStore(bn_mlp(), WORKERS, REPLICAS)
    store.spool(tmp_path, recovered_from=-1)
    store.put(0, 3, slot(1.0))
    (tmp_path / "buffers-000000003-w0.part").write_bytes(b"torn")
    with pytest.raises(JournalUnusable, match="cannot be taken back"):
        BufferStore(bn_mlp(), WORKERS, REPLICAS).spool(tmp_path, recovered_from=-1)


def test_a_coordinator_restarted_from_its_journal_commits_the_checkpoint_whose_buffers_it_received(tmp_path):
    first = make_job(tmp_path)
    start(first)
    for step in range(3):
        for worker in range(WORKERS):
            if (step, worker) != (2, 0):  # worker 0's report of step 2 comes after the restart
                first.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=8, step_s=0.1))
    first.checkpoint_buffers(0, 3, slot(1.0))  # both slots uploaded (a worker uploads once), no shard confirmed
    first.checkpoint_buffers(1, 3, slot(2.0))
    assert first.checkpoint_step == -1
    # the coordinator dies here (kill -9: nothing more is flushed) and is started again on its journal
    second = make_job(tmp_path, taken_back=recovery(tmp_path / JOURNAL_NAME))
    assert second.recovered
    second.report_step(StepReport(worker_id=0, step=2, loss=1.0, samples=8, step_s=0.1))
    for shard in range(3):
        second.checkpoint_written(shard, 3)
    assert second.checkpoint_step == 3  # without the uploads kept on disk it would wait for them forever
    found = second.slot_buffers(1, 3)
    assert found is not None and torch.equal(found[1]["1/1.running_var"], slot(2.0)["1/1.running_var"])
    assert buffer_files(tmp_path / "ckpt") == [3] and part_files(tmp_path / "ckpt") == []
    second.close()
    first.close()


def test_an_upload_is_refused_or_skipped_before_its_payload_is_read(tmp_path):
    job = make_job(tmp_path)
    start(job)
    (tmp_path / "plain").mkdir()
    off = make_job(tmp_path / "plain", raw={**RAW, "checkpoint": {"every_steps": 0}})  # a job without checkpoints
    start(off)
    add = pb_grpc.add_CoordinatorServicer_to_server
    servers = [start_server("127.0.0.1:0", [(add, CoordinatorServicer(j))], ["Coordinator"]) for j in (job, off)]
    channels = [open_channel(f"127.0.0.1:{server.port}") for server in servers]
    huge = pb.TensorChunk(name="0/1.running_mean", dtype=pb.FLOAT32, shape=[1 << 40])  # refused once it is read

    def parts(step: int) -> list[pb.SlotBuffersPart]:
        return [pb.SlotBuffersPart(header=pb.SlotBuffersHeader(worker_id=0, step=step)), pb.SlotBuffersPart(chunk=huge)]

    try:
        with pytest.raises(grpc.RpcError) as not_a_checkpoint:
            pb_grpc.CoordinatorStub(channels[0]).UploadSlotBuffers(iter(parts(2)), timeout=10)
        assert not_a_checkpoint.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a checkpoint step" in not_a_checkpoint.value.details()
        with pytest.raises(grpc.RpcError) as no_checkpoints:
            pb_grpc.CoordinatorStub(channels[1]).UploadSlotBuffers(iter(parts(3)), timeout=10)
        refused = no_checkpoints.value
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "takes no checkpoints" in refused.details()

        for step in range(3):
            for worker in range(WORKERS):
                job.report_step(StepReport(worker_id=worker, step=step, loss=1.0, samples=8, step_s=0.1))
        for shard in range(3):
            job.checkpoint_written(shard, 3)
        job.checkpoint_buffers(0, 3, slot(1.0))
        job.checkpoint_buffers(1, 3, slot(2.0))
        assert job.checkpoint_step == 3
        pb_grpc.CoordinatorStub(channels[0]).UploadSlotBuffers(iter(parts(3)), timeout=10)  # committed: OK, unread
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop(0)
        job.close()
        off.close()
