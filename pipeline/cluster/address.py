"""Whether a Ray cluster's address answers, before ``ray.init`` waits on it.

Given a head node's address where nothing listens, ``ray.init`` retries its connection for minutes (over 3 minutes
measured with 127.0.0.1:1 under Ray 2.60), so a job that cannot start would hold its Slurm slot or Airflow task that
long before it says so. One TCP connection with a short timeout tells at once.
"""

from __future__ import annotations

import socket
from typing import Optional

GCS_PORT = 6379      # `ray start --head`'s default
CLIENT_PORT = 10001  # Ray Client's (ray://)
CONNECT_S = 5.0


def unreachable(address: Optional[str], timeout: float = CONNECT_S) -> Optional[str]:
    """Why nothing answers at ``address`` (host:port, or ray://host[:port]), or None where it answers or where the
    address is not one to try: auto and local, which Ray resolves itself, or none (a local cluster)."""
    if not address or address in ("auto", "local"):
        return None
    rest, default = address, GCS_PORT
    if rest.startswith("ray://"):
        rest, default = rest[len("ray://"):], CLIENT_PORT
    elif "://" in rest:
        return None
    rest = rest.split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or host.endswith(":"):  # no port given (or an IPv6 address without brackets)
        host, port = rest, str(default)
    try:
        number = int(port)
    except ValueError:
        return None  # not host:port: Ray's own error says what is wrong with it
    host = host.strip("[]")
    try:
        with socket.create_connection((host, number), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer from {host}:{number} in {timeout:g} s"
    except OSError as e:
        return f"nothing answers at {host}:{number}: {e.strerror or e}"
