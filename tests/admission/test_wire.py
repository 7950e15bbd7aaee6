"""moe_cohort.admission.wire: the compact profile form the proxy forwards and the engine decodes, and Prediction."""

import numpy as np
import pytest

from moe_cohort.admission.wire import COMPACT_TOP, Prediction, compact, decode_profile, expand

E = COMPACT_TOP + 4  # experts per layer


def test_compact_keeps_each_layers_top_experts_quantised():
    rng = np.random.default_rng(2)
    p = rng.random((3, 20)).astype(np.float32)
    codes = compact(p, top=4)
    assert len(codes) == 12 and all(isinstance(c, int) for c in codes)
    back = expand(codes, 3, 20)
    for layer in range(3):
        top = np.argsort(-p[layer])[:4]
        np.testing.assert_allclose(back[layer, top], p[layer, top], atol=0.5 / 255 + 1e-6)
        assert np.count_nonzero(back[layer]) <= 4
        rest = np.setdiff1d(np.arange(20), top)
        assert (back[layer, rest] == 0).all()


def test_expand_rejects_experts_outside_the_model():
    with pytest.raises(ValueError, match="experts"):
        expand([9 * 256 + 10], 1, 8)


def test_profiles_round_trip_and_malformed_ones_are_refused():
    u = np.zeros((2, E))
    u[0, :COMPACT_TOP] = np.linspace(0.1, 0.9, COMPACT_TOP)
    u[1, 3:3 + COMPACT_TOP] = 0.5
    assert np.allclose(decode_profile(compact(u), E), u.ravel(), atol=1 / 255)
    good = compact(u)
    for bad in ([], good[:-1], [0.5] * COMPACT_TOP, "1,2", [True] * COMPACT_TOP, None, [E * 256] * COMPACT_TOP):
        assert decode_profile(bad, E) is None


def test_a_prediction_of_a_profile_carries_the_flat_vector_and_its_wire_form():
    u = np.random.default_rng(3).random((2, E))
    got = Prediction.of_profile(u)
    assert got.vector.dtype == np.float32 and got.vector.shape == (2 * E,)
    np.testing.assert_allclose(got.vector, u.ravel(), rtol=1e-6)
    assert got.compact == compact(u)
    np.testing.assert_allclose(decode_profile(got.compact, E), expand(compact(u), 2, E).ravel())


def test_with_xargs_sets_keys_over_a_copy_of_what_the_body_had():
    from moe_cohort.admission.wire import PROFILE_KEY, ROUTING_KEY, with_xargs

    theirs = {"theirs": 1, ROUTING_KEY: "topk"}
    merged = with_xargs(theirs, **{ROUTING_KEY: "oea", PROFILE_KEY: [3]})
    assert merged == {"theirs": 1, ROUTING_KEY: "oea", PROFILE_KEY: [3]}
    assert theirs == {"theirs": 1, ROUTING_KEY: "topk"}  # unchanged
    assert with_xargs(None, **{ROUTING_KEY: "topk"}) == {ROUTING_KEY: "topk"}
