"""The README's main job, exactly as a user runs it."""

import json
import uuid

from tests.helpers import REPO_ROOT, pids_with_marker, run_local


def test_digits_reaches_95_percent_heldout_accuracy(tmp_path):
    marker = uuid.uuid4().hex
    result = run_local(REPO_ROOT / "examples" / "digits.yaml", tmp_path / "digits", marker, timeout_s=420)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "digits" / "eval.json").read_text())
    assert results["heldout_accuracy"] >= 0.95
    assert f"heldout_accuracy {results['heldout_accuracy']:.4f}" in result.stdout
    assert not pids_with_marker(marker)
