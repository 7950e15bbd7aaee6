"""run_batch (the batch driver) against a stand-in vLLM (tests/helpers/vllm_stub.py): a quick RunConfig, a
completion answer, one run."""

from __future__ import annotations

import asyncio

from moe_cohort.batch.core import RunConfig
from moe_cohort.batch.journal import Journal, JournalPaths
from moe_cohort.batch.run import run_batch
from moe_cohort.send.backend_client import BackendClient
from tests.helpers.vllm_stub import local_backend

OK = {"id": "cmpl", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
CONFIG = RunConfig(max_in_flight=3, max_retries=3, backoff_s=0.001, max_backoff_s=0.01, metrics_interval_s=0)


def run(tmp_path, parsed, handler, config=CONFIG, predictor=None):
    """Run `parsed` against a local server answering with `handler`; (stats, journal paths)."""
    paths = JournalPaths.for_output(tmp_path / "out.jsonl")

    async def main():
        async with local_backend(handler) as url:
            backend = BackendClient(url, timeout_s=0.3)
            journal = Journal.open(paths, parsed.journal_meta)
            try:
                return await run_batch(parsed, journal, [backend], predictor, config)
            finally:
                journal.close()
                await backend.close()

    return asyncio.run(main()), paths
