"""The PS shard's gauges, read from the process's registry while real pulls wait on a real gRPC server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from prometheus_client import REGISTRY

from pstrain.runtime.ps_client import PsClient
from tests.helpers import wait_for
from tests.test_pull_capacity import CHUNK_BYTES, DEADLINE_S, NUMEL, serve


def test_the_readme_s_ps_metrics_all_exist():
    import pstrain.ps_server.metrics  # noqa: F401 - registers them

    names = {family.name for family in REGISTRY.collect()}
    for name in (
        "pstrain_ps_version",
        "pstrain_ps_shard_bytes",
        "pstrain_ps_pushes_waiting",
        "pstrain_ps_pulls_waiting",
    ):
        assert name in names, name


def test_pulls_waiting_counts_the_pulls_that_wait_for_an_unpublished_version():
    server, servicer, shard, address = serve(workers=2)
    clients = [PsClient([address], NUMEL, chunk_bytes=CHUNK_BYTES, pull_timeout_s=DEADLINE_S) for _ in range(2)]
    pullers = ThreadPoolExecutor(max_workers=2)
    try:
        pulls = [pullers.submit(c.pull, 1, torch.zeros(NUMEL)) for c in clients]
        assert servicer.wait_until_pulls_waiting(2, DEADLINE_S)
        assert REGISTRY.get_sample_value("pstrain_ps_pulls_waiting") == 2
        for w, client in enumerate(clients):
            client.push(torch.ones(NUMEL), w, 0, 1).wait()
        assert [p.result(DEADLINE_S) for p in pulls] == [1, 1]
        wait_for(lambda: REGISTRY.get_sample_value("pstrain_ps_pulls_waiting") == 0, 10, "no pull waiting")
    finally:
        for client in clients:
            client.close(cancel=True)  # a pull still waiting ends now
        pullers.shutdown(wait=True)
        shard.close()
        server.stop(0)
