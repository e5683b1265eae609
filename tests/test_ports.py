"""``runtime.ports.free_port``: a port the kernel never hands to a port-0 bind or an outgoing connection."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pstrain.runtime import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, high = ports.ephemeral_range()
    assert 0 < low <= high
    if low <= ports.LOWEST + 100:
        pytest.skip(f"this host's ephemeral range starts at {low}: no room below it")
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 3, 65535))
        picked = {ports.free_port() for _ in range(30)}  # from taken, taken + 1, taken + 2: never the one in use
        assert taken not in picked and picked & {taken + 1, taken + 2}


def test_without_room_below_the_range_the_kernel_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_low, kernel_high = ports.ephemeral_range()  # where the kernel's own port-0 binds come from
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", range_file)
    assert ports.ephemeral_range() == (1024, 65535)
    assert all(kernel_low <= ports.free_port() <= kernel_high for _ in range(5))  # bound port 0: the kernel chose
    range_file.write_text("garbage")
    assert ports.ephemeral_range() == (32768, 60999)  # Linux's default
