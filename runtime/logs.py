"""Process-wide logging: one line per event, tagged with the service and pid (journald-friendly)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """``--log-level``'s argparse type: a level name in any case, upper-cased.

    Checked while parsing the flags, so a typo exits 2 with argparse's usage line; found later, in
    ``configure_logging``, it was a traceback and exit 1, which a unit or ``pstrain local`` restarts forever.
    """
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {value!r}; use one of {', '.join(LOG_LEVELS)}")
    return level


def configure_logging(service: str, level: str = "INFO") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(
        level=numeric,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service}[{os.getpid()}] %(name)s: %(message)s",
        force=True,
    )
