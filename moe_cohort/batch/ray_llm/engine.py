"""The engine stage of batch/ray_llm/processor.py that hands each row's expert counts on.

`ObservingEngineUDF` is Ray's own engine stage (tested on Ray 2.60, whose stage class is internal) with one
addition: a row sent with a `moe_observe` token (batch/ray_llm/processor.py's preprocess) has the counts our plugin took
of its request fetched from the engine once it finished (`cohort_take_observed`, as the proxy's learner
fetches them over HTTP: engine/observed_endpoint.py) and put in the run's box (batch/ray_llm/box.py), a Ray actor
the driver reads. Every such row is counted there as finished, counts or not. The row's output is the plain
stage's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

import ray
from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStageUDF

from moe_cohort.admission.wire import OBSERVE_KEY
from moe_cohort.batch.ray_llm.box import ENV_BOX

log = logging.getLogger(__name__)

TAKE_TRIES, TAKE_WAIT_S = 20, 0.05  # the plugin finishes a request's counts one engine step after its answer


class ObservingEngineUDF(vLLMEngineStageUDF):
    async def _generate_with_error_handling(self, row: dict[str, Any], batch_uuid: uuid.UUID) -> dict[str, Any]:
        token = ((row.get("sampling_params") or {}).get("extra_args") or {}).get(OBSERVE_KEY)
        out = await super()._generate_with_error_handling(row, batch_uuid)
        if token:
            found = {} if out.get("__inference_error__") else await self._take_observed(token)
            if not found and not out.get("__inference_error__"):
                log.warning("no expert counts from the engine for %s (the moe-cohort plugin not loaded?)", token)
            self._box().put.remote(found)
        return out

    async def _take_observed(self, token: str) -> dict[str, dict]:
        for _ in range(TAKE_TRIES):
            found: dict[str, dict] = {}
            for part in await self.llm.engine.collective_rpc("cohort_take_observed", args=([token],)):
                found.update(part or {})  # the first tensor-parallel rank counts; the others answer {}
            if found:
                return found
            await asyncio.sleep(TAKE_WAIT_S)
        return {}

    def _box(self):
        if getattr(self, "_observation_box", None) is None:
            self._observation_box = ray.get_actor(os.environ[ENV_BOX])
        return self._observation_box
