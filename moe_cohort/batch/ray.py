"""`cohort batch run --runner ray`: the same batch run, sent through Ray Data to one or more vLLM replicas.

    cohort batch run --runner ray --input big.jsonl --output results.jsonl \
        --backend http://replica-1:8000,http://replica-2:8000

Who does what:
- the driver (this process) validates the file, opens the journal and computes the sending order as
  the local runner's `--dry-run` plan does (batch/order.py: admission by predicted experts,
  `max_in_flight` at a time; file order with --encoder none), leaving out lines an earlier run finished;
- Ray Data holds the ordered requests as a Dataset cut into contiguous blocks of `block_rows` rows
  (a run of the plan, so alike requests travel together) and maps every block with `_SendBlock`, a
  pool of one actor per replica. For a block, an actor leases a free replica (a ray.util.queue.Queue
  of replica indexes, so no replica has two blocks at once) and sends the block's requests in order,
  `max_in_flight` at a time, with the local runner's own code (`run_batch` over the block: the same
  retries and the same output lines); finished blocks stream back as they end, in any order;
- the driver is the journal's one writer (batch/journal.py), so resume is the local runner's: a line
  is finished when its journal entry is on disk; a block that was out when a run stopped is sent
  again by the next run and its lines appear once in the results.
- a replica that stays unreachable stops the run: its actor raises a stop flag (a second Queue), every
  block that has not started yet is skipped, the blocks already out finish, and the driver commits
  every finished block before it raises RunAborted. Ray Data runs an actor's blocks out of order
  (`allow_out_of_order_execution`), so the block that stopped is not always after those that finished:
  the driver drains them all instead of stopping at the first block that stopped.

Ray is started here (a local instance) unless this process is already connected, or RAY_ADDRESS
names a cluster (then `ray.init()` joins it). Prompts are user data: nothing here logs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Callable, Sequence

from moe_cohort.batch.core import BatchCore, RunConfig, RunStats, left_to_run
from moe_cohort.batch.format import BatchFile, BatchRequest
from moe_cohort.batch.journal import Journal, JournalError, Record
from moe_cohort.batch.run import RunAborted
from moe_cohort.send.settings import Settings

log = logging.getLogger(__name__)

BLOCK_BATCHES = 8  # a block holds this many `max_in_flight`-sized batches of the plan
ACTOR_CPUS = 0.25  # an actor only waits on HTTP; a fraction of a CPU lets several share a core
LEASE_TIMEOUT_S = 600.0
_ABORT = -1  # the `line` of the row that says a block stopped (its `data`: why)
_SKIPPED = -2  # the `line` of the row that says a block was not sent: the run had stopped


def ray_problem() -> str | None:
    """Why --runner ray cannot run in this environment (None: it can)."""
    try:
        import ray.data  # noqa: F401
    except ImportError as exc:
        return f"--runner ray needs Ray Data ({exc}): pip install 'moe-cohort[ray]', or use --runner local"
    return None


def run_batch_ray(settings: Settings, batch: BatchFile, journal: Journal, predictor, *, skip_invalid: bool = True,
                  on_progress: Callable[[RunStats], None] | None = None, block_rows: int | None = None) -> RunStats:
    """Finish every line of `batch` that `journal` has not, as `batch.run.run_batch` does (invalid
    ones into the error file with `skip_invalid`), the valid ones sent by Ray Data. Raises RunAborted
    when a replica stays unreachable (what finished is committed)."""
    import ray
    import ray.data

    from moe_cohort.batch.order import admission_plan

    pending, stats = left_to_run(batch, journal, skip_invalid)
    config = RunConfig.from_settings(settings, metrics_interval_s=0)
    urls = list(settings.backends)
    if not pending:
        return stats
    order, _ = admission_plan(pending, predictor, config.max_in_flight)
    started = _connect(ray)
    try:
        counters0 = _read_counters(urls)
        rows = block_rows or BLOCK_BATCHES * config.max_in_flight
        with contextlib.closing(_send_blocks(ray, order, urls, config, settings, rows)) as blocks:
            for records in blocks:
                _commit(journal, records)
                BatchCore([], config, stats).committed(records)  # counts them into `stats`
                (on_progress or (lambda s: None))(stats)
        counters = _read_counters(urls)
        stats.decode = None if counters is None or counters0 is None else counters - counters0
    finally:
        if started:
            ray.shutdown()
    return stats


def _commit(journal: Journal, records: list[Record]) -> None:
    try:
        journal.commit(records)
    except (JournalError, OSError) as exc:  # disk full, ...: the journal rolled its files back
        raise RunAborted(f"cannot write the results: {exc}") from exc


def _send_blocks(ray, order: Sequence[BatchRequest], urls: list[str], config: RunConfig, settings: Settings,
                 block_rows: int):
    """The records of each finished block, as blocks finish; RunAborted once every block has come back if one
    stopped (the records of every block that finished, before or after it, have been yielded)."""
    from ray.util.queue import Queue

    leases, stop = Queue(), Queue()  # free replica indexes; non-empty once a block stopped the run
    for index in range(len(urls)):
        leases.put(index)
    rows = [{"line": r.line, "custom_id": r.custom_id, "url": r.url, "body": json.dumps(r.body), "policy": r.policy}
            for r in order]  # in sending order; from_items keeps it, cutting contiguous blocks
    ds = ray.data.from_items(rows, override_num_blocks=-(-len(rows) // block_rows))
    sent = ds.map_batches(_SendBlock, batch_size=block_rows, batch_format="numpy", num_cpus=ACTOR_CPUS,
                          compute=ray.data.ActorPoolStrategy(size=len(urls)),
                          fn_constructor_kwargs={"urls": urls, "config": config, "leases": leases, "stop": stop,
                                                 "timeout_s": settings.request_timeout_s,
                                                 "connect_timeout_s": settings.connect_timeout_s})
    blocks = iter(sent.iter_batches(batch_size=None, batch_format="numpy"))
    why: list[str] = []  # the reasons blocks stopped, as they came back
    try:
        for block in blocks:
            records, stopped = read_block(block)
            yield records
            why += stopped
    except ray.exceptions.RayError as exc:  # a worker or actor died: what finished is committed
        raise RunAborted(f"Ray Data stopped: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    finally:
        blocks.close()  # stops Ray Data's executor now if the caller left early: blocks still out are abandoned
    if why:
        raise RunAborted(why[0])


def read_block(block: dict) -> tuple[list[Record], list[str]]:
    """A block's rows back from `_SendBlock`: its records, and why it stopped ([] if it did not, or was skipped)."""
    lines, kinds, data = block["line"], block["kind"], block["data"]
    records = [Record(int(line), str(kind), json.loads(d)) for line, kind, d in zip(lines, kinds, data) if line >= 0]
    return records, [str(d) for line, d in zip(lines, data) if line == _ABORT]


class _SendBlock:
    """A Ray Data actor: sends one block at a time to a leased replica, in the block's order."""

    def __init__(self, urls: list[str], config: RunConfig, leases, stop, timeout_s: float,
                 connect_timeout_s: float) -> None:
        self.urls, self.config, self.leases, self.stop = urls, config, leases, stop
        self.timeouts = {"timeout_s": timeout_s, "connect_timeout_s": connect_timeout_s}

    def __call__(self, block: dict) -> dict:
        requests = [BatchRequest(int(line), str(cid), str(url), json.loads(body), str(policy), "")
                    for line, cid, url, body, policy in
                    zip(block["line"], block["custom_id"], block["url"], block["body"], block["policy"])]
        index = self.leases.get(timeout=LEASE_TIMEOUT_S)
        try:
            if not self.stop.empty():  # another block stopped the run: this one is left for the rerun
                return {"line": [_SKIPPED], "kind": ["errors"], "data": [""]}
            records, stopped = asyncio.run(self._send(self.urls[index], requests))
        finally:
            self.leases.put(index)
        rows = [(r.line, r.kind, json.dumps(r.data, ensure_ascii=False)) for r in records]
        if stopped:
            self.stop.put(stopped)
            rows.append((_ABORT, "errors", stopped))
        return {"line": [r[0] for r in rows], "kind": [r[1] for r in rows], "data": [r[2] for r in rows]}

    async def _send(self, url: str, requests: list[BatchRequest]) -> tuple[list[Record], str | None]:
        """The block through the local runner (file order: the block is already in admission order)."""
        from moe_cohort.batch.run import run_batch
        from moe_cohort.send.backend_client import BackendClient

        kept = _Collected()
        backend = BackendClient(url, **self.timeouts)
        try:
            await run_batch(BatchFile(requests=requests), kept, [backend], None, self.config, skip_invalid=False)
            return kept.records, None
        except RunAborted as exc:
            return kept.records, str(exc)
        finally:
            await backend.close()


class _Collected:
    """What run_batch needs of a journal, in memory: a block's records go back to the driver's journal."""

    def __init__(self) -> None:
        self.done: dict[int, str] = {}
        self.records: list[Record] = []

    def commit(self, records: list[Record]) -> None:
        self.records.extend(records)


def _connect(ray) -> bool:
    """Join the running Ray (this process's, or RAY_ADDRESS's cluster), else start a local one; True if started here."""
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the CLI has its own bar
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its per-run INFO lines; failures still raise here
    if ray.is_initialized():
        return False
    ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": len(os.sched_getaffinity(0))}),
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    return True


def _read_counters(urls: list[str]):
    """The replicas' summed decode counters (send/engine_counters.py); None if one cannot be read."""
    from moe_cohort.send.backend_client import BackendClient
    from moe_cohort.send.engine_counters import fetch_counters

    async def read():
        clients = [BackendClient(u, timeout_s=10) for u in urls]
        try:
            return await fetch_counters(clients)
        finally:
            for c in clients:
                await c.close()

    return asyncio.run(read())
