"""What a shard's handlers check before they touch the shard (issue 8): who calls, for whom, how many wait.

``ShardGate`` is installed by ``pstrain-ps`` once its registration returned the job key:

* a push for worker ``w`` must carry ``w``'s credential (``runtime/identity.py``) and a device
  count no larger than the job's ``devices_per_worker``; anything else is refused first, on the
  server's loop, before the shard is asked (no thread hop, no shard lock) and before the payload
  is read, so the shard stays exactly as it was and a flood of forged pushes costs a MAC each;
* a pull must carry some member's credential, and is held only within ``PullLimits``
  (``runtime/admission.py``), per shard and per peer (the member, else its connection), as the job file
  sets them (``pull_limits``: ``transport.max_waiting_pulls``, ``transport.max_waiting_pulls_per_peer``).

A gate without keys (a servicer a test or benchmark builds alone) binds no identities.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.errors import InvalidArgument
from pstrain.runtime.admission import PullAdmission, PullLimits
from pstrain.runtime.identity import MemberVerifier

Metadata = Iterable[tuple[str, str | bytes]] | None


def pull_limits(job: pb.JobSpec) -> PullLimits:
    """The job file's pull limits (``transport.max_waiting_pulls[_per_peer]``, ``pull_timeout_s``); 0 in the spec
    (a coordinator that does not send them) keeps the default."""
    default = PullLimits()
    per_shard = job.max_waiting_pulls or default.per_shard
    return PullLimits(
        per_shard=per_shard,
        per_peer=min(job.max_waiting_pulls_per_peer or default.per_peer, per_shard),
        max_wait_s=job.pull_timeout_s if job.pull_timeout_s > 0 else default.max_wait_s,
    )


class ShardGate:
    def __init__(
        self, keys: MemberVerifier | None = None, max_devices: int | None = None, pulls: PullLimits | None = None
    ) -> None:
        self.keys = keys
        self.max_devices = max_devices
        self.pulls = PullAdmission(pulls or PullLimits())

    def check_push(self, metadata: Metadata, worker_id: int, device_count: int) -> None:
        """PermissionDenied unless the caller is worker ``worker_id``; InvalidArgument for too many devices."""
        if self.keys is not None:
            self.keys.require(metadata, "worker", worker_id)
        if self.max_devices is not None and device_count > self.max_devices:
            raise InvalidArgument(
                f"worker {worker_id} claims {device_count} devices; the job registered {self.max_devices} per worker"
            )

    @contextmanager
    def pull(self, metadata: Metadata, peer: str, requested_wait_s: float | None) -> Iterator[float]:
        """Admit one waiting pull (PermissionDenied, Overloaded); yields the server-side wait limit."""
        who = self.keys.verify(metadata).name if self.keys is not None else peer
        with self.pulls.admit(who, requested_wait_s) as wait_s:
            yield wait_s
