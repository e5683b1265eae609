"""bench/openmp.py runs each policy in a process of its own and writes its table (a short run: 1 round, 2 steps)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO_ROOT


def test_the_openmp_bench_times_both_policies_and_writes_its_table(tmp_path):
    out = tmp_path / "openmp.md"
    cmd = [sys.executable, "bench/openmp.py", "--rounds", "1", "--steps", "2", "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for batch in (64, 256):  # one line per run, each policy in its own process
        assert re.search(rf"batch {batch} round 1 default *: \d+\.\d ms", run.stdout)
        assert re.search(rf"batch {batch} round 1 PASSIVE *: \d+\.\d ms", run.stdout)
    row = re.compile(r"^\| (\d+) \| ([\d.]+) \([\d.]+\) \| ([\d.]+) \([\d.]+\) \| \*\*([\d.]+)x\*\*", re.M)
    rows = row.findall(out.read_text())
    assert [int(r[0]) for r in rows] == [64, 256]
    for _, spin, passive, ratio in rows:
        assert abs(float(ratio) - float(passive) / float(spin)) < 0.01 + 0.01 * float(ratio)
