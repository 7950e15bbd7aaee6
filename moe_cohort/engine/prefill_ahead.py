"""How many requests our scheduler prefills ahead of decode, and the model-runner slots that takes.

Read where vLLM builds its config (the plugin's EngineArgs.create_engine_config) and by engine.scheduler; no vLLM
import. The environment variable:

    COHORT_PREFILL_AHEAD  requests prefilled and held ahead of decode (default: AHEAD_PER_SLOT x max_num_seqs;
                          0: off). The more are held, the wider the choice of the one to decode next, and the
                          more KV the held prompts take: no request is taken in to be held at a step that
                          starts with the KV cache AHEAD_KV_SHARE full (`active_limit`), so that the decoding
                          requests keep room to grow (a step's own admissions may pass the share once)
"""

from __future__ import annotations

import os

from moe_cohort.engine.engine_info import DECODE_SLOTS_ATTR, decode_slots, scheduler_info

ENV_AHEAD = "COHORT_PREFILL_AHEAD"
AHEAD_PER_SLOT = 16  # the default held ahead per decode slot (docs/results.md, "One prefill")
AHEAD_KV_SHARE = 0.5  # past this share of the KV cache in use, requests enter RUNNING only to fill decode slots


def prefill_ahead(max_num_seqs: int, environ=None) -> int:
    """Requests prefilled and held ahead of decode (COHORT_PREFILL_AHEAD; unset: AHEAD_PER_SLOT per decode slot;
    0: off)."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_AHEAD, str(AHEAD_PER_SLOT * max_num_seqs))
    if not text.isdigit():
        raise ValueError(f"{ENV_AHEAD} must be a whole number of requests >= 0 (0: no prefill ahead), got {text!r}")
    return int(text)


def reserve_prefill_ahead(vllm_config) -> None:
    """Where vLLM's scheduler is ours and prefill ahead is on: the model runner gets max_num_seqs + ahead slots,
    and the user's max_num_seqs is kept as the decode width (`DECODE_SLOTS_ATTR`). Runs where vLLM builds its
    config (the plugin's EngineArgs.create_engine_config), before the runner and the scheduler exist; once."""
    config = vllm_config.scheduler_config
    if decode_slots(config) is not None or not _is_ours(config):
        return
    ahead = prefill_ahead(config.max_num_seqs)
    if ahead == 0:
        return
    setattr(config, DECODE_SLOTS_ATTR, config.max_num_seqs)
    config.max_num_seqs += ahead
    config.max_num_batched_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)


def _is_ours(scheduler_config) -> bool:
    return scheduler_info(scheduler_config)["expert_aware"]


def active_limit(decode_slots: int, runner_slots: int, running: int, kv_usage: float) -> int:
    """How many requests may be in RUNNING after this step's admissions (vLLM's `max_num_active_reqs`): all the
    runner's slots while the KV cache is under AHEAD_KV_SHARE full; past it, no more than are there already,
    and never fewer than the decode slots (work conservation: a free decode slot is filled from the waiting)."""
    if kv_usage < AHEAD_KV_SHARE:
        return runner_slots
    return min(runner_slots, max(decode_slots, running))
