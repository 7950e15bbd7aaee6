"""Trace recording by position and holes; a folder of recorded files reads as one set (no vLLM needed)."""

import numpy as np

from moe_cohort.engine.recorder import TraceRecorder
from moe_cohort.traces.format import load_trace_file
from moe_cohort.traces.importers import load_traces

L, K, E = 3, 2, 8


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((n, L, E)), axis=-1)[..., :K]  # [n, L, k] distinct per token
    return experts, rng.random((n, L, K)).astype(np.float32)


def _recorder(tmp_path, **kw):
    return TraceRecorder(tmp_path, num_layers=L, num_experts=E, top_k=K, model="tiny", **kw)


def test_rows_by_position_make_one_trace_file(tmp_path):
    rec = _recorder(tmp_path, decode_text=lambda ids: "text:" + ",".join(map(str, ids)))
    prefill, decode1, decode2 = _rows(5, 0), _rows(1, 1), _rows(1, 2)
    rec.add_rows("cmpl-a/1", "topk", 0, *prefill)
    rec.add_rows("cmpl-a/1", "topk", 5, *decode1)
    rec.add_rows("cmpl-a/1", "topk", 6, *decode2)
    path = rec.finish("cmpl-a/1", prompt_token_ids=[1, 2, 3, 4, 5], output_token_ids=[6, 7, 8])
    assert path.name == "cmpl-a_1.npz"
    ts = load_traces(path)  # the project's trace reader
    assert len(ts) == 1 and ts.request_ids.tolist() == ["cmpl-a/1"]
    assert ts.num_prompt_tokens.tolist() == [5] and ts.num_tokens.tolist() == [7]  # last token never ran
    np.testing.assert_array_equal(ts.experts, np.concatenate([prefill[0], decode1[0], decode2[0]]))
    np.testing.assert_array_equal(ts.weights, np.concatenate([prefill[1], decode1[1], decode2[1]]))
    assert ts.texts.tolist() == ["text:1,2,3,4,5"]
    assert ts.extra["policy"] == "topk" and ts.extra["token_ids"] == [1, 2, 3, 4, 5, 6, 7]
    assert not rec.is_recording("cmpl-a/1")


def test_recomputed_positions_overwrite_instead_of_appending(tmp_path):
    rec = _recorder(tmp_path)
    rec.add_rows("r", "topk", 0, *_rows(4, 0))
    rec.add_rows("r", "topk", 4, *_rows(1, 1))
    again = _rows(5, 2)  # preempted, then recomputed from position 0
    rec.add_rows("r", "topk", 0, *again)
    ts = load_trace_file(rec.finish("r", [1, 2, 3, 4], [5, 6]))
    np.testing.assert_array_equal(ts.experts, again[0])


def test_capacity_grows_for_long_requests(tmp_path):
    rec = _recorder(tmp_path)
    rows = _rows(300, 0)
    for start in range(0, 300, 7):
        rec.add_rows("long", "topk", start, rows[0][start:start + 7], rows[1][start:start + 7])
    ts = load_trace_file(rec.finish("long", list(range(100)), list(range(201))))
    assert ts.num_tokens.tolist() == [300] and ts.num_prompt_tokens.tolist() == [100]
    np.testing.assert_array_equal(ts.experts, rows[0])


def test_a_hole_skips_the_request_with_a_warning(tmp_path, caplog):
    rec = _recorder(tmp_path)
    rec.add_rows("cached", "topk", 4, *_rows(3, 0))  # positions 0..3 came from the prefix cache
    assert rec.finish("cached", [1, 2, 3, 4, 5, 6], [7]) is None
    assert "position 0 was never computed" in caplog.text
    assert not list(tmp_path.glob("*.npz"))


def test_unknown_request_writes_nothing(tmp_path):
    assert _recorder(tmp_path).finish("never-seen", [1], [2]) is None


def test_a_folder_of_recorded_requests_loads_as_one_set(tmp_path):
    rec = _recorder(tmp_path)
    for i, policy in enumerate(["topk", "lynx-lat;drop=2", "topk"]):
        rows = _rows(3 + i, i)
        rec.add_rows(f"req{i}", policy, 0, *rows)
        rec.finish(f"req{i}", [1, 2], [3] * (2 + i))
    ts = load_traces(tmp_path)  # what `cohort eval/train --traces DIR` read
    assert ts.request_ids.tolist() == ["req0", "req1", "req2"]
    assert ts.num_tokens.tolist() == [3, 4, 5] and ts.num_prompt_tokens.tolist() == [2, 2, 2]
    assert ts.extra["policies"] == {"req0": "topk", "req1": "lynx-lat;drop=2", "req2": "topk"}
    np.testing.assert_array_equal(ts.request_experts(1), _rows(4, 1)[0])
