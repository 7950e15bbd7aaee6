"""Per-request options and the per-step request spans (no vLLM needed)."""

import numpy as np
import pytest

from moe_cohort.engine.engine_state import (DECODE, MIXED, PREFILL, RecordingOff, RequestOptions, build_step,
                                             parse_flag, request_options)
from moe_cohort.engine.policy import PolicyError, TopK, parse_policy

XSHARE = parse_policy("xshare;m=4;k0=1")  # changes prefill too
LYNX = parse_policy("lynx-lat;drop=2")  # decode only


def test_request_options_defaults_and_overrides():
    assert request_options(None) == RequestOptions(TopK(), False)
    assert request_options({}, XSHARE, True) == RequestOptions(XSHARE, True)
    opts = request_options({"moe_routing": "lynx-lat;drop=2", "moe_record": "true", "other": 1}, record_requests=True)
    assert opts == RequestOptions(LYNX, True)


@pytest.mark.parametrize("record_all, record_requests, asked, recorded", [
    (False, False, None, False), (False, False, True, False), (False, False, False, False),  # off: a request's true is ignored
    (False, True, None, False), (False, True, True, True), (False, True, False, False),  # on request
    (True, False, None, True), (True, False, True, True), (True, False, False, False),  # all: a request may opt out
])
def test_a_request_is_recorded_only_as_the_operator_allows(record_all, record_requests, asked, recorded):
    """Issue 27: a client's moe_record made the plugin write its prompt to the engine's disk on any server."""
    extra = {} if asked is None else {"moe_record": asked}
    assert request_options(extra, TopK(), record_all, record_requests).record is recorded
    if asked and not (record_all or record_requests):  # the API server's check refuses it (a 400)
        with pytest.raises(RecordingOff, match="COHORT_RECORD_TRACES=request"):
            request_options(extra, TopK(), record_all, record_requests, strict=True)
    else:
        assert request_options(extra, TopK(), record_all, record_requests, strict=True).record is recorded


@pytest.mark.parametrize("extra, fragment", [
    ({"moe_routing": "nonsense"}, "unknown policy 'nonsense'"),
    ({"moe_routing": "xshare;m=0"}, "key 'm'"),
    ({"moe_routing": 5}, "must be a policy string"),
    ({"moe_record": "maybe"}, "moe_record must be true or false"),
    ({"moe_record": 2}, "moe_record must be true or false"),
])
def test_request_options_rejects_bad_values_with_a_clear_message(extra, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        request_options(extra)


def test_bad_policy_raises_policy_error():
    with pytest.raises(PolicyError):
        request_options({"moe_routing": "oea"})


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (1, True), (0, False),
                                             ("yes", True), ("Off", False), (" 1 ", True)])
def test_parse_flag(value, expected):
    assert parse_flag(value) is expected


def _opts(policy, record=False):
    return RequestOptions(policy, record)


def test_build_step_spans_phases_and_groups():
    # r0: prefill chunk of 5 prompt tokens; r1, r2: one decode token each; r3: last prompt chunk.
    step = build_step(["r0", "r1", "r2", "r3"], [0, 5, 6, 7, 10], positions=[0, 12, 9, 4],
                      num_prompt_tokens=[8, 10, 9, 7],
                      options=[_opts(LYNX), _opts(LYNX, True), _opts(TopK()), _opts(XSHARE)])
    assert [(s.req_id, s.start, s.end, s.phase) for s in step.spans] == [
        ("r0", 0, 5, PREFILL), ("r1", 5, 6, DECODE), ("r2", 6, 7, DECODE), ("r3", 7, 10, PREFILL)]
    assert step.num_tokens == 10
    assert step.groups == ((PREFILL, "lynx-lat;drop=2"), (DECODE, "lynx-lat;drop=2"), (DECODE, "topk"),
                           (PREFILL, "xshare;m=4;k0=1"))
    assert step.token_group.tolist() == [0] * 5 + [1, 2] + [3] * 3
    assert step.group_tokens == (5, 1, 1, 3)
    assert step.batch_labels == (MIXED, MIXED)
    assert step.record and not step.all_topk
    # decode-only policies leave prefill rows at top-k; other policies apply to prefill too
    assert [type(s.effective_policy).__name__ for s in step.spans] == ["TopK", "LynxLat", "TopK", "XShare"]


def test_step_of_decode_only_policy_in_prefill_is_all_topk():
    step = build_step(["a", "b"], [0, 3, 6], [0, 0], [3, 3], [_opts(LYNX), _opts(TopK())])
    assert step.all_topk and not step.record
    assert step.batch_labels == (PREFILL, MIXED)


def test_empty_step():
    step = build_step([], [0], [], [], [])
    assert step.num_tokens == 0 and step.spans == () and step.all_topk
    assert step.token_group.dtype == np.int64 and step.token_group.size == 0


def test_steady_steps_are_decode_only_and_unrecorded():
    decode = build_step(["a", "b"], [0, 1, 2], [5, 7], [3, 3], [_opts(LYNX), _opts(TopK())])
    assert decode.steady
    assert not build_step(["a"], [0, 1], [5], [3], [_opts(TopK(), record=True)]).steady  # positions matter
    assert not build_step(["a", "b"], [0, 1, 4], [5, 0], [3, 3], [_opts(TopK())] * 2).steady  # b in prefill
