"""Backend clients that are never sent anything, for tests of the admission slots alone."""

from __future__ import annotations


def idle_clients(n: int) -> list:
    """`n` backend clients for tests of the slots alone: they are never sent anything (port 9, discard)."""
    from moe_cohort.send.backend_client import BackendClient

    return [BackendClient("http://127.0.0.1:9") for _ in range(n)]
