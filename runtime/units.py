"""Byte sizes as job files and flags write them (``"80GiB"``, ``"512MB"``, ``"12GB/s"``).

Shared by the job-file schema, the plan and the memory planner, so that reading a size does
not make the schema depend on the planner.

Units follow SI/IEC as disk and network vendors write them: ``KB``/``MB``/``GB``/``TB`` are
decimal (``16GB`` = 16e9 bytes, ``12GB/s`` = 12e9 bytes per second, as PCIe and NIC rates are
quoted) and ``KiB``/``MiB``/``GiB``/``TiB`` are binary (``16GiB`` = 16 * 2**30, as GPU and host
memory is sized; prefer them for ``memory.device_memory``/``host_memory``). Case does not matter.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)")


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"``, ``"512MB"``, ``"1.5e9"`` -> bytes; a rate (``"12GB/s"``) reads as bytes per second."""
    if isinstance(text, (int, float)):
        value = float(text) if isinstance(text, float) else text
    else:
        match = _SIZE.fullmatch(text.strip().lower().replace(" ", "").removesuffix("/s"))
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"cannot read {text!r} as a size: use e.g. 80GiB, 512MB or 1e9")
        value = float(match.group(1)) * _UNITS[match.group(2)]
    if isinstance(value, float) and not math.isfinite(value):  # "1e400" reads as inf: no int holds it
        raise ValueError(f"{text!r} is too large: not a finite number of bytes")
    return int(value)
