"""Who is in the job: PS shards and workers by role, their registration and their liveness.

A member is alive while it was heard from (registration, readiness, a heartbeat, a step report)
within the heartbeat timeout. A PS shard id is taken by one process at a time: another address
may take it only once the holder went silent (a shard restarted elsewhere). A registration that
names a live member's own address takes its slot only with that member's current credential
(``proven``: the process itself, registering again); without it, it is refused (``HolderAlive``,
UNAVAILABLE: the registering member retries) until the holder has been silent for the heartbeat
timeout. Why: anyone with the bearer token can name any address, so an address is no proof of a
restart, and taking a live member's slot fails or rolls back the running job. Worker ids are handed
out in registration order until the plan's slots are full. A worker slot whose holder failed is
``vacate``-d (S2.5): the next worker to register takes it, as ``replacement``, with the failed
worker's devices. A slot left vacant past the replacement timeout may be ``dropped``
(``cluster.min_workers``): it waits for nobody, and a worker that registers later may take it back
(``take_dropped``). Each heartbeat's RSS is kept as a sample in the member's ``MemoryHistory``;
``ps_memory`` forecasts the PS shards' memory from them (S2.4).

A restarted coordinator takes the members back from its journal (``snapshot``/``restore`` and the
registrations since): each is alive from the restart on, so a member that reattaches within the
heartbeat timeout simply goes on, and one that does not is a silent member as any other.

Plain and not thread-safe: the ``Job`` calls it only with its lock held. The clock is injected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pstrain.coordinator.errors import (
    AlreadyRegistered,
    CoordinatorError,
    InvalidRequest,
    NoFreeSlot,
    UnknownMember,
)
from pstrain.coordinator.memory_forecast import MemoryHistory, PsMemoryForecast, forecast_ps_memory
from pstrain.runtime.memory_trend import DEFAULT_SETTINGS, TrendSettings

log = logging.getLogger(__name__)

ROLES = ("ps", "worker")

TAKEOVER_GRACE_S = 5.0
"""How long after a registration was last refused for a live holder's slot (``HolderAlive``) that slot does not
fail the job once its holder falls silent. Why: the refused member (a restart at the same address) retries every
2 s at most (``MemberProcess.join``) and takes the slot at its next try; without the grace, the liveness check
would fail the job (before the start: a cluster restart) in the very moment the holder's timeout lets it in."""


class HolderAlive(CoordinatorError):
    """A registration would take the slot of a member still heard from, without that member's current credential:
    refused with nothing changed (UNAVAILABLE: a genuine restart retries until its predecessor is silent)."""


@dataclass
class Member:
    """The coordinator's record of one member process; heartbeats move ``last_seen``."""

    role: str  # "ps" | "worker"
    id: int
    address: str
    last_seen: float
    ready: bool = False
    done: bool = False  # a worker past its last step, a PS told to stop
    hostname: str = ""
    metrics_address: str = ""
    devices: list[str] = field(default_factory=list)  # what a worker registered with (its replacement gets them)
    failed: bool = False  # a worker declared failed; its slot waits for a replacement (S2.5)
    failed_at: float = 0.0
    replacement: bool = False  # this worker took the slot of a failed one
    dropped: bool = False  # failed and not replaced in time: the job goes on without the slot (cluster.min_workers)
    memory: MemoryHistory = field(default_factory=MemoryHistory)  # RSS from heartbeats; a re-registration starts anew
    claimed_at: float | None = None  # a registration for this live slot was last refused then (``HolderAlive``)


@dataclass(frozen=True)
class MemberView:
    """A member as ``status()`` reports it."""

    role: str
    id: int
    address: str
    alive: bool
    last_seen_s_ago: float
    metrics_address: str


class Membership:
    def __init__(
        self,
        job_id: str,
        ps_shards: int,
        workers: int,
        devices_per_worker: int,
        heartbeat_timeout_s: float,
        clock: Callable[[], float],
        memory_settings: TrendSettings = DEFAULT_SETTINGS,
    ) -> None:
        self.job_id = job_id
        self.ps_shards = ps_shards
        self.workers = workers
        self.devices_per_worker = devices_per_worker
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._memory_settings = memory_settings
        self._ps: dict[int, Member] = {}
        self._workers: dict[int, Member] = {}

    # ------------------------------------------------------------------ registration

    def check_takeover(self, member: Member, proven: bool) -> None:
        """Refuse (``HolderAlive``) a registration that would take ``member``'s slot while ``member`` is alive,
        unless it carries ``member``'s current credential (``proven``: the holder's own process registering again).

        Why: a registration names its address, and anyone holding the bearer token can name a live member's; taken
        as that member's restart, it would fail or roll back the running job, or take the worker's slot and its
        credential. A real restart loses nothing by waiting: its predecessor is dead and falls silent within the
        heartbeat timeout. The refusal is noted on the holder (``claimed_at``, see ``TAKEOVER_GRACE_S``) and
        changes nothing else: the holder keeps its slot and its credential."""
        if proven or not self.alive(member):
            return
        now = self._clock()
        member.claimed_at = now
        who = f"worker {member.id} at {member.address} (host {member.hostname or '?'})"
        if member.role == "ps":
            who = f"ps shard {member.id} at {member.address}"
        raise HolderAlive(
            f"{who} was heard from {now - member.last_seen:.1f} s ago; a restart takes its slot once it has been "
            f"silent for transport.heartbeat_timeout_s ({self.heartbeat_timeout_s:g} s)"
        )

    def check_ps_claim(self, shard_id: int, address: str, proven: bool = False) -> None:
        """A registration for ``shard_id`` from ``address`` may take the shard: its holder is silent (or there is
        none), or it is the holder at this address with proof (``check_takeover``). A live holder at another
        address keeps the shard (``AlreadyRegistered``). Changes nothing but a refused claim's note."""
        if not 0 <= shard_id < self.ps_shards:
            raise InvalidRequest(f"shard id {shard_id} out of range: this job has shards 0..{self.ps_shards - 1}")
        existing = self._ps.get(shard_id)
        if existing is None:
            return
        if existing.address != address and self.alive(existing):
            raise AlreadyRegistered(f"shard {shard_id} is already served by {existing.address}")
        self.check_takeover(existing, proven)

    def register_ps(self, shard_id: int, address: str, metrics_address: str = "", proven: bool = False) -> Member:
        """Shard ``shard_id`` is served from ``address``; ``proven``: the call carries the shard's credential."""
        self.check_ps_claim(shard_id, address, proven)
        member = Member("ps", shard_id, address, self._clock(), metrics_address=metrics_address)
        self._ps[shard_id] = member
        log.info("PS shard %d registered at %s", shard_id, address)
        return member

    def ps_ready(self, shard_id: int) -> None:
        member = self._ps.get(shard_id)
        if member is None:
            raise UnknownMember(f"shard {shard_id} never registered")
        member.ready = True
        member.last_seen = self._clock()

    def register_worker(
        self, address: str, devices: list[str], hostname: str, metrics_address: str = "", take_dropped: bool = False
    ) -> Member:
        if devices and len(devices) != self.devices_per_worker:
            raise InvalidRequest(
                f"worker offers {len(devices)} devices but the plan needs {self.devices_per_worker} "
                f"per worker (cluster.devices_per_worker)"
            )
        vacant = self.vacant_slots() or (self.dropped_slots() if take_dropped else [])
        if len(self._workers) >= self.workers and not vacant:
            raise NoFreeSlot(f"all {self.workers} worker slots of job {self.job_id} are taken")
        replacing = len(self._workers) >= self.workers
        worker_id = vacant[0] if replacing else min(set(range(self.workers)) - self._workers.keys())
        if replacing and not devices:
            devices = self._workers[worker_id].devices  # configured like the failed worker
        member = Member(
            "worker",
            worker_id,
            address,
            self._clock(),
            ready=True,
            hostname=hostname,
            metrics_address=metrics_address,
            devices=list(devices),
            replacement=replacing,
        )
        self._workers[worker_id] = member
        what = "replaces failed worker" if replacing else "registered as worker"
        log.info("%s %d from %s (%s)", what, worker_id, hostname, address)
        return member

    def vacate(self, worker_id: int) -> Member:
        """Declare a worker failed: its slot waits for a replacement (S2.5)."""
        member = self.worker(worker_id)
        if not member.failed:
            member.failed = True
            member.failed_at = self._clock()
        return member

    def drop_slot(self, worker_id: int) -> None:
        """A job resumed from a checkpoint that went on without slot ``worker_id``: it stays dropped (nobody
        registers for it; a worker that comes once every other slot is held takes it back, ``take_dropped``)."""
        member = Member("worker", worker_id, "", self._clock(), failed=True, failed_at=self._clock(), dropped=True)
        self._workers[worker_id] = member

    def vacant_slots(self) -> list[int]:
        """Worker slots whose holder failed and that no replacement took yet, lowest first."""
        return sorted(i for i, m in self._workers.items() if m.failed and not m.dropped)

    def dropped_slots(self) -> list[int]:
        """Worker slots the job went on without (cluster.min_workers); a later worker may take one back."""
        return sorted(i for i, m in self._workers.items() if m.dropped)

    def silent_workers(self) -> list[int]:
        """Workers with work left, not yet declared failed, silent past the heartbeat timeout (and not about to be
        taken by a registration refused while they were alive, ``TAKEOVER_GRACE_S``)."""
        now = self._clock()
        return [m.id for m in self._workers.values() if not m.failed and not m.done and self._gone(m, now)]

    def _gone(self, member: Member, now: float) -> bool:
        """Silent past the heartbeat timeout, and no registration refused for its slot within ``TAKEOVER_GRACE_S``:
        that registration (its restart, retrying) takes the slot at its next try, as the restart it is."""
        if now - member.last_seen <= self.heartbeat_timeout_s:
            return False
        return member.claimed_at is None or now - member.claimed_at > TAKEOVER_GRACE_S

    def occupied_workers(self) -> list[tuple[int, str]]:
        """(id, address) of every worker slot held by a process not declared failed."""
        return [(m.id, m.address) for m in self._workers.values() if not m.failed]

    # ------------------------------------------------------------------ lookups

    def ps(self, shard_id: int) -> Member:
        member = self._ps.get(shard_id)
        if member is None:
            raise UnknownMember(f"shard {shard_id} must register before fetching its parameters")
        return member

    def worker(self, worker_id: int) -> Member:
        member = self._workers.get(worker_id)
        if member is None:
            raise UnknownMember(f"worker {worker_id} is not registered in job {self.job_id}")
        return member

    def has_worker(self, worker_id: int) -> bool:
        return worker_id in self._workers

    @property
    def worker_count(self) -> int:
        return len(self._workers)

    def all_ps_ready(self) -> bool:
        return len(self._ps) == self.ps_shards and all(m.ready for m in self._ps.values())

    def all_ps_done(self) -> bool:
        """Every PS shard heard the end of the job, or is gone (silent past the timeout)."""
        return all(m.done or not self.alive(m) for m in self._ps.values())

    def restarted_ps(self, shard_id: int, address: str) -> bool:
        """A registration for a held shard id from its own address, or after its holder went silent:
        the shard's process restarted. Only for a registration ``check_ps_claim`` let through: a live holder
        elsewhere is refused, and so is one at this address unless the registration proved it is that holder."""
        existing = self._ps.get(shard_id)
        return existing is not None and (existing.address == address or not self.alive(existing))

    def registered_at(self, address: str, hostname: str) -> Member | None:
        """The worker (not failed) registered at ``address`` from ``hostname``, if any; none for an address without a
        port of its own (empty, or port 0), which names no one process. The host too: two hosts may advertise one
        address (containers, a loopback bind), one host cannot run two live processes on one port."""
        if not address or address.rpartition(":")[2] in ("", "0"):
            return None
        found = (m for m in self._workers.values() if not m.failed and m.address == address and m.hostname == hostname)
        return next(found, None)

    def register_again(
        self, worker_id: int, devices: list[str], hostname: str, metrics_address: str = "", proven: bool = False
    ) -> Member:
        """Before the job starts, a worker that registers again at its address (its process restarted, or its
        registration's reply was lost and it retried) takes its own slot back, not a second one: at once with the
        slot's current credential (``proven``), else once the old holder is silent (``check_takeover``)."""
        old = self._workers[worker_id]
        self.check_takeover(old, proven)
        if devices and len(devices) != self.devices_per_worker:
            raise InvalidRequest(
                f"worker offers {len(devices)} devices but the plan needs {self.devices_per_worker} "
                f"per worker (cluster.devices_per_worker)"
            )
        member = Member(
            "worker",
            worker_id,
            old.address,
            self._clock(),
            ready=True,
            hostname=hostname,
            metrics_address=metrics_address,
            devices=list(devices or old.devices),
        )
        self._workers[worker_id] = member
        log.info("worker %d registered again from %s (%s): it keeps its slot", worker_id, hostname, old.address)
        return member

    def restarted_worker(self, address: str, hostname: str) -> int | None:
        """The slot of a worker that restarted: one registered at ``address``, or a silent one on ``hostname``.
        A slot whose holder is still alive is the caller's to ``check_takeover`` before acting on it."""
        for m in self._workers.values():
            if m.failed:
                continue
            if m.address == address or (hostname and m.hostname == hostname and not self.alive(m)):
                return m.id
        return None

    def missing_ps(self) -> list[int]:
        """PS shard ids not (yet) registered and ready."""
        return [i for i in range(self.ps_shards) if not (i in self._ps and self._ps[i].ready)]

    def ps_addresses(self) -> list[str]:
        """Addresses in shard order; every shard must have registered."""
        return [self._ps[i].address for i in range(self.ps_shards)]

    # ------------------------------------------------------------------ liveness

    def heard_from(self, role: str, member_id: int, rss_bytes: int = 0) -> Member:
        """A heartbeat: the member is alive now, and its RSS (0: not measured) is a memory sample."""
        if role not in ROLES:
            raise InvalidRequest(f"unknown role {role!r}; use 'ps' or 'worker'")
        member = (self._ps if role == "ps" else self._workers).get(member_id)
        if member is None:
            raise UnknownMember(f"{role} {member_id} is not registered")
        member.last_seen = self._clock()
        member.memory.add(member.last_seen, rss_bytes)
        return member

    def ps_memory(self, end_s: float | None) -> PsMemoryForecast:
        """The PS shards' memory forecast now, extrapolated to ``end_s`` where a shard still grows (S2.4)."""
        histories = {i: m.memory.samples for i, m in self._ps.items()}
        return forecast_ps_memory(histories, self._clock(), end_s, self._memory_settings)

    def alive(self, member: Member) -> bool:
        return not member.failed and self._clock() - member.last_seen <= self.heartbeat_timeout_s

    def alive_count(self, role: str) -> int:
        members = self._ps if role == "ps" else self._workers
        return sum(1 for m in members.values() if self.alive(m))

    def silent(self) -> str | None:
        """Why the job must fail: the first member with work left that is silent past the timeout, if any."""
        now = self._clock()
        for member in self.members():
            if not member.done and not member.failed and self._gone(member, now):
                return f"{member.role} {member.id} at {member.address} silent for {now - member.last_seen:.0f}s"
        return None

    # ------------------------------------------------------------------ the journal's snapshot

    _KEPT = (
        "role",
        "id",
        "address",
        "ready",
        "done",
        "hostname",
        "metrics_address",
        "devices",
        "failed",
        "replacement",
        "dropped",
    )

    def snapshot(self) -> list[dict[str, Any]]:
        """Every member as plain JSON (liveness and memory samples are not kept: they restart)."""
        return [{k: getattr(m, k) for k in self._KEPT} for m in self.members()]

    def restore(self, members: list[dict[str, Any]]) -> None:
        """Take a ``snapshot``'s members back, every one heard from now (it has the heartbeat timeout to
        reattach); a worker declared failed waits for its replacement from now."""
        now = self._clock()
        self._ps, self._workers = {}, {}
        for fields in members:
            member = Member(**{k: fields[k] for k in self._KEPT if k in fields}, last_seen=now)
            (self._ps if member.role == "ps" else self._workers)[member.id] = member
        self.restart_clocks()

    def restart_clocks(self) -> None:
        """Every member heard from now, as ``restore`` does: the restarted coordinator answers only from
        here, and no member can reattach while the coordinator loads the job and starts its server
        (seconds on a loaded host)."""
        now = self._clock()
        for member in self.members():
            member.last_seen = now
            member.failed_at = now

    def members(self) -> list[Member]:
        return [*self._ps.values(), *self._workers.values()]

    def views(self) -> list[MemberView]:
        now = self._clock()
        return [
            MemberView(
                role=m.role,
                id=m.id,
                address=m.address,
                alive=not m.failed and now - m.last_seen <= self.heartbeat_timeout_s,
                last_seen_s_ago=now - m.last_seen,
                metrics_address=m.metrics_address,
            )
            for m in self.members()
        ]
