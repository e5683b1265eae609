"""OpenMP's wait policy for pstrain's processes: passive, unless the operator set one.

torch's CPU kernels run on an OpenMP thread pool (libgomp in the Linux wheels). By default each
of its threads spins for a while after every parallel region, betting that the next one follows
at once: right for one process that owns the machine and computes back to back, wrong for a
pstrain host. There a worker and one or more shards run side by side, and each makes short CPU
passes (a bucket's host copy, a piece's sum and update, a publishing copy) between waits on the
network: every pass leaves a pool of spinning threads that take the cores the other processes
need next. On a 16-core GPU host with one worker and two shards, the default spin cost the shards
110-119 ms of CPU per 20 ms step; with ``OMP_WAIT_POLICY=PASSIVE`` in every process's environment,
27-32 ms, and the MLP-64 step fell from 19.3-19.7 to 12.5 ms (``bench/results/step_cuda.md``). A
worker that trains on CPU devices pays for sleeping between its parallel regions; on 2 threads the
price did not show (``bench/results/openmp.md``).

The policy is read once, when torch loads the OpenMP library, so the services' entry points
(``python -m pstrain.<service>`` and the ``pstrain-*`` console scripts) set it before anything
imports torch. An operator who wants spinning back sets ``OMP_WAIT_POLICY=ACTIVE`` (or the unit's
``Environment=``): a value already in the environment is kept.
"""

from __future__ import annotations

import os
import sys
import warnings

VARIABLE = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def prefer_passive_waits() -> bool:
    """Make OpenMP's threads sleep when idle unless the environment says otherwise.

    Returns False, with a warning, when torch is already imported and no policy was set: the
    OpenMP library has read the environment, and this process keeps spinning (its children,
    which inherit the variable, do not). Something imported torch first (a ``sitecustomize``?).
    """
    chosen = VARIABLE in os.environ
    os.environ.setdefault(VARIABLE, PASSIVE)
    if "torch" not in sys.modules:
        return True
    if not chosen:
        warnings.warn(
            f"torch was imported before pstrain set {VARIABLE}={PASSIVE}: this process keeps OpenMP's default "
            f"(spinning) waits; set {VARIABLE} in its environment to choose",
            RuntimeWarning,
            stacklevel=2,
        )
    return False
