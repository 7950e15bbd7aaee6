import json

import numpy as np
import pytest

from tests.conftest import random_traces
from moe_cohort.traces.format import TraceFormatError, TraceSet, load_trace_file, save_traces


def test_round_trip_keeps_every_array(tmp_path, small_traces):
    path = save_traces(tmp_path / "t", small_traces)
    assert path.name == "t.npz"
    back = load_trace_file(path)
    for name in ("token_offsets", "experts", "num_prompt_tokens", "request_ids", "weights", "texts", "categories"):
        np.testing.assert_array_equal(getattr(back, name), getattr(small_traces, name))
    assert (back.num_experts, back.num_layers, back.top_k) == (10, 3, 2)
    assert back.experts.dtype == np.uint8


def test_subset_slices_tokens_of_each_request(small_traces):
    sub = small_traces.subset([5, 0, 7])
    for j, i in enumerate([5, 0, 7]):
        np.testing.assert_array_equal(sub.request_experts(j), small_traces.request_experts(i))
    assert sub.request_ids.tolist() == ["r5", "r0", "r7"]


def _kwargs(ts: TraceSet) -> dict:
    return dict(num_experts=ts.num_experts, num_layers=ts.num_layers, top_k=ts.top_k, token_offsets=ts.token_offsets,
                experts=ts.experts, num_prompt_tokens=ts.num_prompt_tokens, request_ids=ts.request_ids)


@pytest.mark.parametrize("change, message", [
    (lambda k: k.update(num_experts=3), r"expert ids must lie in \[0, 3\)"),
    (lambda k: k.update(experts=k["experts"][:, :2]), r"experts must have shape \[tokens=\d+, layers=3, k=2\]"),
    (lambda k: k.update(experts=k["experts"].astype(np.float32)), "experts must be integer ids"),
    (lambda k: k.update(token_offsets=k["token_offsets"] + 1), "token_offsets must start at 0"),
    (lambda k: k.update(num_prompt_tokens=k["num_prompt_tokens"] + 100), "num_prompt_tokens must lie in"),
    (lambda k: k.update(request_ids=np.array(["x"] * len(k["request_ids"]))), "request_ids must be unique"),
    (lambda k: k.update(top_k=20, experts=np.zeros((int(k["token_offsets"][-1]), 3, 20), np.uint8)), "top_k .* exceeds"),
])
def test_inconsistent_arrays_are_rejected_with_the_reason(small_traces, change, message):
    kwargs = _kwargs(small_traces)
    change(kwargs)
    with pytest.raises(TraceFormatError, match=message):
        TraceSet(**kwargs)


def test_bad_files_name_the_problem(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceFormatError, match="not a readable .npz"):
        load_trace_file(tmp_path / "junk.npz")
    np.savez(tmp_path / "nometa.npz", experts=np.zeros((1, 1, 1)))
    with pytest.raises(TraceFormatError, match="no 'meta' entry"):
        load_trace_file(tmp_path / "nometa.npz")


def test_newer_version_and_missing_arrays_are_rejected(tmp_path):
    ts = random_traces()
    path = save_traces(tmp_path / "t.npz", ts)
    with np.load(path) as z:
        arrays = dict(z)
    meta = json.loads(str(arrays["meta"]))
    np.savez(tmp_path / "v2.npz", **{**arrays, "meta": np.array(json.dumps({**meta, "version": 2}))})
    with pytest.raises(TraceFormatError, match="version 2; this reader supports"):
        load_trace_file(tmp_path / "v2.npz")
    np.savez(tmp_path / "partial.npz", **{k: v for k, v in arrays.items() if k != "experts"})
    with pytest.raises(TraceFormatError, match=r"missing arrays \['experts'\]"):
        load_trace_file(tmp_path / "partial.npz")
    np.savez(tmp_path / "ids.npz", **{**arrays, "experts": arrays["experts"] + 50})
    with pytest.raises(TraceFormatError, match=r"ids.npz: expert ids must lie in"):
        load_trace_file(tmp_path / "ids.npz")
