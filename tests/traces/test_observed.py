"""Observed expert counts: vLLM's routed_experts rows and the plugin's wire form against brute-force counts."""

import base64
import io

import numpy as np
import pytest

from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.observed import BadObservation, Observed, decode_npy, from_routed_experts
from moe_cohort.train.targets import profiles


def _rows(rng, tokens, layers=3, experts=8, k=2):  # [tokens, L, k] distinct ids per token and layer
    return np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(tokens)])


def _brute(rows, experts):
    out = np.zeros((rows.shape[1], experts), np.int64)
    for token in rows:
        for layer, ids in enumerate(token):
            for e in ids:
                out[layer, e] += 1
    return out


def test_counts_split_prompt_and_generated_tokens_like_a_loop():
    rng = np.random.default_rng(0)
    rows = _rows(rng, 11).astype(np.uint8)  # 7 prompt tokens + 5 generated, the last never forwarded
    obs = from_routed_experts(rows, prompt_tokens=7, num_experts=8)
    np.testing.assert_array_equal(obs.prompt, _brute(rows[:7], 8))
    np.testing.assert_array_equal(obs.decode, _brute(rows[7:], 8))
    assert (obs.prompt_tokens, obs.decode_tokens, obs.top_k) == (7, 4, 2)


def test_rows_without_their_first_prompt_tokens_split_where_the_prompt_ends():
    rng = np.random.default_rng(1)
    rows = _rows(rng, 10)
    obs = from_routed_experts(rows[3:], prompt_tokens=6, num_experts=8, prompt_start=3)
    np.testing.assert_array_equal(obs.prompt, _brute(rows[3:6], 8))
    assert (obs.prompt_tokens, obs.decode_tokens) == (3, 4)


def test_profile_is_the_training_target_of_the_same_request_as_a_decode_trace():
    rng = np.random.default_rng(2)
    rows = _rows(rng, 13, layers=2, experts=6, k=2)
    ts = TraceSet(num_experts=6, num_layers=2, top_k=2, token_offsets=np.array([0, 13]), experts=rows.astype(np.uint8),
                  weights=np.ones(rows.shape, np.float32), num_prompt_tokens=np.array([5]), request_ids=np.array(["r"]))
    obs = from_routed_experts(rows, prompt_tokens=5, num_experts=6)
    np.testing.assert_allclose(obs.profile(), profiles(ts)[0], rtol=1e-6)


def test_a_request_that_generated_nothing_is_profiled_by_its_prompt():
    rows = _rows(np.random.default_rng(3), 4)
    obs = from_routed_experts(rows, prompt_tokens=9, num_experts=8)
    assert obs.decode_tokens == 0
    np.testing.assert_allclose(obs.profile(), _brute(rows, 8) / 4)


def test_wire_form_round_trips_through_json_text():
    import json

    obs = from_routed_experts(_rows(np.random.default_rng(4), 9), prompt_tokens=4, num_experts=8)
    back = Observed.from_wire(json.loads(json.dumps(obs.to_wire())))
    np.testing.assert_array_equal(back.prompt, obs.prompt)
    np.testing.assert_array_equal(back.decode, obs.decode)
    assert (back.prompt_tokens, back.decode_tokens) == (obs.prompt_tokens, obs.decode_tokens)


def _b64(array):
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def test_vllm_base64_npy_is_read_and_a_pickle_is_not():
    rows = _rows(np.random.default_rng(5), 3).astype(np.uint16)
    np.testing.assert_array_equal(decode_npy(_b64(rows)), rows)
    with pytest.raises(BadObservation, match="not base64 .npy"):
        decode_npy(_b64(np.array([{"a": 1}], dtype=object)))
    with pytest.raises(BadObservation, match="not base64"):
        decode_npy("not base64!")
    with pytest.raises(BadObservation, match="expected base64"):
        decode_npy(3)


@pytest.mark.parametrize("rows, match", [(np.zeros((3, 2)), "shape"), (np.full((2, 1, 2), 9), "outside"),
                                         (np.zeros((2, 1, 2), np.float32), "integer")])
def test_bad_routing_rows_say_what_is_wrong(rows, match):
    with pytest.raises(BadObservation, match=match):
        from_routed_experts(rows, prompt_tokens=1, num_experts=8)


@pytest.mark.parametrize("obj, match", [([], "object with"), ({"prompt_tokens": 1, "decode_tokens": 1, "counts": "x"}, "base64"),
                                        ({"prompt_tokens": -1, "decode_tokens": 1, "counts": _b64(np.zeros((2, 1, 3), np.uint32))}, "non-negative"),
                                        ({"prompt_tokens": 1, "decode_tokens": 1, "counts": _b64(np.zeros((3, 1, 3), np.uint32))}, r"\[2, L, E\]")])
def test_bad_wire_objects_say_what_is_wrong(obj, match):
    with pytest.raises(BadObservation, match=match):
        Observed.from_wire(obj)
