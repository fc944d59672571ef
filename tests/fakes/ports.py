"""Free TCP ports for servers a test starts, chosen outside the kernel's ephemeral range.

``bind(("127.0.0.1", 0))`` hands out a port from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range every outgoing connection and
every "random free port" of a Temporal dev server draws from; a port picked that way and
closed can be taken again before the server under test binds it. Ports below the range
are only ever taken by an explicit bind, so the window is closed in practice.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct ports nothing listens on, below the ephemeral range (all held while choosing)."""
    low, high = 20000, _ephemeral_low() - 1
    rng = random.Random()  # noqa: S311 - not a secret; separate runs should not pick alike
    held: list[socket.socket] = []
    try:
        while len(held) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randint(low, high)))
            except OSError:
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()
