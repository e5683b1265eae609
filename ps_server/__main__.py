"""``python -m pstrain.ps_server`` and the console script: OpenMP's wait policy first (``runtime.openmp``)."""

import sys

from pstrain.runtime.openmp import prefer_passive_waits


def run() -> int:
    prefer_passive_waits()  # before torch loads OpenMP: the import below brings torch in
    from pstrain.ps_server.main import main

    return main()


if __name__ == "__main__":
    sys.exit(run())
