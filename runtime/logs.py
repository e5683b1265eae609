"""Process-wide logging: one line per event, tagged with the service and pid (journald-friendly)."""

from __future__ import annotations

import logging
import os
import sys


def configure_logging(service: str, level: str = "INFO") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(
        level=numeric,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service}[{os.getpid()}] %(name)s: %(message)s",
        force=True,
    )
