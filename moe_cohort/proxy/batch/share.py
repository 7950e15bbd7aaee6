"""The Batch API's background slots, shared by the batches that run at once: round-robin over tenants,
and over each tenant's batches.

The proxy sends at most `slots` batch requests (Settings.max_in_flight_for_batches) to the backend at a time,
whatever the number of batches. Every running batch asks for a slot before each request it sends
(`Seat.acquire`) and gives it back when that request is finished (`Seat.release`). A slot that frees
goes to the next tenant in turn that has a request waiting, and within that tenant to its next
batch in turn; a tenant or batch that was served goes to the back of the line. So a 1-line batch
waits for about one request of each other tenant, never for a whole batch, and a tenant does not
get a bigger share by splitting its work into many batches (round-robin over batches alone would
give it one share per batch). Slots nobody waits for are taken at once: a batch alone uses them all.

Tenants are the batches' owners (send/auth.py: a key's hash, a named tenant, or "" on an open proxy).
Nothing here touches a socket or a file; waiting is an asyncio future per request.
"""

from __future__ import annotations

import asyncio
from collections import deque


class FairShare:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a share needs at least one slot, got {slots}")
        self.slots = self.free = slots
        self._waiting: dict[str, dict[str, deque[asyncio.Future]]] = {}  # tenant -> batch -> waiters, in turn order

    def resize(self, slots: int) -> None:
        """Share `slots` from now on (the engines' handshake: send/autoconfig.plan_batch); requests out beyond a
        smaller size finish as they are, and no slot is handed out until they did."""
        if slots < 1:
            raise ValueError(f"a share needs at least one slot, got {slots}")
        self.free, self.slots = self.free + slots - self.slots, slots
        self._release(0)

    def seat(self, tenant: str, batch: str) -> "Seat":
        """The handle one batch of `tenant` takes its slots with."""
        return Seat(self, tenant, batch)

    @property
    def waiting(self) -> int:
        return sum(len(q) for batches in self._waiting.values() for q in batches.values())

    async def _acquire(self, tenant: str, batch: str) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, {}).setdefault(batch, deque()).append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # granted, but the waiter left before using the slot
            else:
                self._forget(tenant, batch, future)
            raise

    def _release(self, freed: int = 1) -> None:
        self.free += freed
        while self.free > 0 and self._waiting:
            tenant = next(iter(self._waiting))
            batches = self._waiting.pop(tenant)
            batch = next(iter(batches))
            waiters = batches.pop(batch)
            self.free -= 1
            waiters.popleft().set_result(None)
            if waiters:
                batches[batch] = waiters  # this batch goes last among its tenant's
            if batches:
                self._waiting[tenant] = batches  # this tenant goes last

    def _forget(self, tenant: str, batch: str, future: asyncio.Future) -> None:
        waiters = self._waiting[tenant][batch]
        waiters.remove(future)
        if not waiters:
            del self._waiting[tenant][batch]
            if not self._waiting[tenant]:
                del self._waiting[tenant]


class Seat:
    """One batch's way to the shared slots: `await acquire()` before a request, `release()` after it."""

    def __init__(self, share: FairShare, tenant: str, batch: str) -> None:
        self.share, self.tenant, self.batch = share, tenant, batch

    async def acquire(self) -> None:
        await self.share._acquire(self.tenant, self.batch)

    def release(self) -> None:
        self.share._release()
