"""engine.prefill_ahead: the default held per decode slot, and the RUNNING limit that keeps held prompts off a KV
cache past AHEAD_KV_SHARE (a brute-force reading of the rule over a grid)."""

import itertools

import pytest

from moe_cohort.engine.prefill_ahead import AHEAD_KV_SHARE, AHEAD_PER_SLOT, active_limit, prefill_ahead


def test_the_default_is_a_fixed_number_per_decode_slot_and_the_variable_wins():
    assert prefill_ahead(4, {}) == AHEAD_PER_SLOT * 4
    assert prefill_ahead(4, {"COHORT_PREFILL_AHEAD": "3"}) == 3 and prefill_ahead(4, {"COHORT_PREFILL_AHEAD": "0"}) == 0
    with pytest.raises(ValueError, match="COHORT_PREFILL_AHEAD must be a whole number"):
        prefill_ahead(4, {"COHORT_PREFILL_AHEAD": "many"})


@pytest.mark.parametrize("slots, runner", [(1, 1), (4, 20), (16, 272)])
def test_past_the_kv_share_no_request_is_taken_in_to_be_held_but_decode_slots_still_fill(slots, runner):
    for running, usage in itertools.product(range(runner + 1), (0.0, AHEAD_KV_SHARE - 1e-6, AHEAD_KV_SHARE, 0.99)):
        limit = active_limit(slots, runner, running, usage)
        assert limit <= runner  # never past the runner's slots
        if usage < AHEAD_KV_SHARE:
            assert limit == runner  # room: every slot of the runner may fill
        else:
            new = max(0, limit - running)  # requests this step may take in from the waiting
            assert new == max(0, slots - running)  # only to fill free decode slots
