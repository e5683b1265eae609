"""Issue 12: a service's own process freezes its start-up objects once ready; an in-process member does not.

``gc.freeze`` keeps what exists out of every later collection, for good: right for a worker, a PS shard or the
coordinator started as a process (their ``main()`` asks for it), wrong for a test process that starts members
in-process and would keep every object it made before.
"""

from __future__ import annotations

import gc

from pstrain.runtime.member import MemberProcess
from tests.test_member import FINISHED, coordinator, make_member, member_args, notify  # noqa: F401 - fixtures


def frozen_by_ready(tmp_path, address: str) -> int:  # type: ignore[no-untyped-def]
    """How many objects ``ready()`` moved to the permanent generation."""
    member = make_member(member_args(address, tmp_path))
    moved: list[int] = []

    def body(m: MemberProcess) -> int:
        before = gc.get_freeze_count()
        m.ready()
        moved.append(gc.get_freeze_count() - before)
        return 0

    assert member.run(body) == 0
    return moved[0]


def test_an_in_process_member_leaves_the_test_process_unfrozen(tmp_path, coordinator, notify) -> None:  # noqa: F811
    _, address = coordinator(FINISHED)
    assert not MemberProcess.freeze_gc_when_ready  # only a service's main() sets it
    assert frozen_by_ready(tmp_path, address) == 0


def test_a_service_process_freezes_its_start_up_objects_when_ready(
    tmp_path,
    coordinator,  # noqa: F811
    notify,  # noqa: F811
    monkeypatch,
) -> None:
    _, address = coordinator(FINISHED)
    monkeypatch.setattr(MemberProcess, "freeze_gc_when_ready", True)  # as ps_server/worker main() set it
    try:
        assert frozen_by_ready(tmp_path, address) > 0
    finally:
        gc.unfreeze()  # this is a test process: give its objects back to the collector
