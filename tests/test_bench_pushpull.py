"""bench/pushpull.py times every path it reports and writes its table (a short run: a 2 MB model, 1 timed step)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO_ROOT


def test_the_pushpull_bench_times_every_path_and_writes_its_table(tmp_path):
    """Each pstrain row is checked inside the bench to have moved its bytes the way it names (no streamed byte on the
    shared-memory rows, every pull off a board, bulk sockets in use): a run that completes took every path."""
    out = tmp_path / "pushpull.md"
    cmd = [sys.executable, "bench/pushpull.py", "--params", "500000", "--steps", "1", "--no-copies",
           "--chunk-kib", "256", "--default-chunk-kib", "256", "--piece-mib", "1", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    table = out.read_text()
    rows = dict(re.findall(r"^\| (pstrain push\+pull [^|]+?) \| ([\d.]+) ms \|", table, re.M))
    assert set(rows) == {
        "pstrain push+pull S=1, bulk sockets",
        "pstrain push+pull S=2, bulk sockets",
        "pstrain push+pull S=1, gRPC stream, chunk 256 KiB",
        "pstrain push+pull S=2, gRPC stream, chunk 256 KiB",
        "pstrain push+pull S=1, shared memory",
        "pstrain push+pull S=2, shared memory",
        "pstrain push+pull S=1, bulk sockets, 1 MiB pieces",
        "pstrain push+pull S=1, shared memory, 1 MiB pieces",
    }
    assert all(float(ms) > 0 for ms in rows.values())
    ratios = re.findall(r"^\| pstrain [^|]+ / (?:raw TCP|gloo all_reduce) \| ([\d.]+) \|", table, re.M)
    assert len(ratios) == 10 and all(float(r) > 0 for r in ratios)
