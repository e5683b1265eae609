"""The layer-wise optimizers' norm exchange between PS processes: the ``LayerNorms`` gRPC service.

A shard's ``NormBoard`` (``pstrain.ps_server.layerwise``) receives its peers' partial squared
norms through ``PostNorms``, which only deposits and returns, so two shards posting to each
other mid-update never wait on each other's handler. ``GrpcPoster`` is the sending side: it
learns the PS shards' addresses from the coordinator (``WaitForCluster``, once, on the first
post: every shard is registered by the time any update runs) and keeps one channel per peer.

Only this job's PS shards may post (issue 8): once registration hands the shard the job key,
``PostNorms`` requires a ``ps`` credential (``runtime/identity.py``) for the shard it posts from,
and refuses anything else with PERMISSION_DENIED (counted and logged by ``runtime/refusals.py``)
before the board is touched: a forged partial norm would skew every trust ratio of the step.
``GrpcPoster``'s channels are the member's, so each post carries this shard's credential.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import grpc

from pstrain.protos import pstrain_pb2 as pb
from pstrain.protos import pstrain_pb2_grpc as pb_grpc
from pstrain.ps_server.layerwise import BoardCombiner, Layers, NormBoard, segments_for
from pstrain.runtime.identity import MemberVerifier, PermissionDenied
from pstrain.runtime.optimizers import optimizer_entry
from pstrain.runtime.security import TransportSecurity
from pstrain.runtime.transport import abort_on_errors, open_channel

POST_TIMEOUT_S = 30.0

translate = abort_on_errors({PermissionDenied: grpc.StatusCode.PERMISSION_DENIED})


class LayerNormsServicer(pb_grpc.LayerNormsServicer):
    """Deposits posted partials on this process's board; thin by design.

    ``keys`` (set by ``pstrain-ps`` once registration returned the job key): only PS shard ``s`` may
    post as ``from_shard`` ``s``. Without keys (a servicer a test builds alone) posts are not bound.
    """

    def __init__(self, board: NormBoard | None = None, keys: MemberVerifier | None = None) -> None:
        self.board = board or NormBoard()
        self.keys = keys

    @translate
    async def PostNorms(self, request: pb.NormPost, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        if self.keys is not None:
            self.keys.require(context.invocation_metadata(), "ps", request.from_shard)
        self.board.deposit(request.step, request.from_shard, {p.param_index: tuple(p.values) for p in request.partials})
        return pb.Empty()


def add_layer_norms(servicer: LayerNormsServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_LayerNormsServicer_to_server(servicer, server)


class GrpcPoster:
    """``post(to_shard, from_shard, step, partials)`` over gRPC, with addresses from the coordinator."""

    def __init__(self, addresses: Callable[[], Sequence[str]], security: TransportSecurity) -> None:
        self._addresses = addresses
        self._security = security
        self._stubs: dict[int, pb_grpc.LayerNormsStub] = {}
        self._channels: list[grpc.Channel] = []
        self._known: list[str] | None = None
        self._lock = threading.Lock()

    def _stub(self, shard: int) -> pb_grpc.LayerNormsStub:
        with self._lock:
            if self._known is None:
                self._known = list(self._addresses())
            if shard not in self._stubs:
                channel = open_channel(self._known[shard], self._security)
                self._channels.append(channel)
                self._stubs[shard] = pb_grpc.LayerNormsStub(channel)
            return self._stubs[shard]

    def __call__(self, to_shard: int, from_shard: int, step: int, partials: Mapping[int, Sequence[float]]) -> None:
        request = pb.NormPost(
            from_shard=from_shard,
            step=step,
            partials=[pb.NormPartial(param_index=i, values=list(v)) for i, v in partials.items()],
        )
        self._stub(to_shard).PostNorms(request, timeout=POST_TIMEOUT_S, wait_for_ready=True)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def layers_for(job: pb.JobSpec, shard_id: int, board: NormBoard, poster: GrpcPoster) -> Layers | None:
    """The shard's ``Layers`` when the job's optimizer is layer-wise, else None."""
    if not optimizer_entry(job.optimizer.name.lower()).layerwise:
        return None
    sizes = [_numel(p.shape) for p in job.params]
    one_d = [len(p.shape) <= 1 for p in job.params]
    return Layers(segments_for(sizes, job.ps_shards, shard_id, one_d), BoardCombiner(shard_id, board, poster))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
