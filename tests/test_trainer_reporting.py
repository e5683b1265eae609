"""The trainer's background step reports (issue 12) leave no thread behind once ``run()`` returns.

Each ``run()`` starts its own one-thread reporting pool and shuts it down in ``finally``: a worker process
builds one Trainer per job it joins, and a test process builds dozens.
"""

from __future__ import annotations

import threading

import pytest

from pstrain.protos import pstrain_pb2 as pb
from pstrain.ps_server.local_client import LocalPsClient
from tests.test_trainer import STEPS, MakeTrainer, Reporter, build_shards, make_trainer  # noqa: F401 - a fixture

JOIN_S = 10.0


def report_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("step-report")}


def assert_ended(threads: set[threading.Thread]) -> None:
    for thread in threads:
        thread.join(JOIN_S)  # an idle pool thread that was shut down ends at once; one never shut down waits forever
    assert not [t.name for t in threads if t.is_alive()]


def test_a_finished_run_leaves_no_report_thread(make_trainer: MakeTrainer) -> None:  # noqa: F811
    before = report_threads()
    reporter = Reporter()
    trainer = make_trainer(0, LocalPsClient(build_shards(workers=1)), reporter)
    assert trainer.run() == STEPS
    assert reporter.steps == list(range(STEPS))  # every report went out before run returned
    assert_ended(report_threads() - before)


def test_a_run_that_fails_on_a_report_leaves_no_report_thread(make_trainer: MakeTrainer) -> None:  # noqa: F811
    before = report_threads()

    def refuse(report: pb.StepReport) -> pb.Directive:
        raise RuntimeError(f"report of step {report.step} refused")

    trainer = make_trainer(0, LocalPsClient(build_shards(workers=1)), Reporter(refuse))
    with pytest.raises(RuntimeError, match="refused"):
        trainer.run()
    assert_ended(report_threads() - before)
