"""The plugin's counts of observed requests against a brute-force count, through chunked prefill, decode steps,
a preemption's recompute, and the hand-over to the proxy."""

import numpy as np

from moe_cohort.engine.expert_counts import ExpertCounts
from moe_cohort.traces.observed import Observed

LAYERS, EXPERTS, K = 3, 8, 2


def _ids(rng, n):  # [n, L, k] distinct experts per token and layer
    return np.stack([np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(LAYERS)]) for _ in range(n)])


def _brute(rows):
    out = np.zeros((LAYERS, EXPERTS), np.int64)
    for token in rows:
        for layer, ids in enumerate(token):
            out[layer, ids] += 1
    return out


def _add(counts, req_id, token, position, num_prompt, ids):  # one request's rows [n, L, k] as a forward's only span
    counts.add_step([(req_id, token, position, num_prompt, 0, len(ids))], ids)


def test_chunked_prefill_and_decode_steps_count_prompt_and_generated_tokens_apart():
    rng = np.random.default_rng(0)
    rows = _ids(rng, 12)  # 7 prompt tokens, 5 generated ones through the model
    counts = ExpertCounts(LAYERS, EXPERTS)
    _add(counts, "r", "tok", 0, 7, rows[0:4])  # a prefill chunk
    _add(counts, "r", "tok", 4, 7, rows[4:8])  # the rest of the prompt and the first generated token
    for p in range(8, 12):
        _add(counts, "r", "tok", p, 7, rows[p:p + 1])
    assert counts.take(["tok"]) == {}  # not finished yet
    counts.finish("r")
    got = Observed.from_wire(counts.take(["tok", "unknown"])["tok"])
    np.testing.assert_array_equal(got.prompt, _brute(rows[:7]))
    np.testing.assert_array_equal(got.decode, _brute(rows[7:]))
    assert (got.prompt_tokens, got.decode_tokens) == (7, 5)
    assert counts.take(["tok"]) == {}  # handed over once


def test_a_recompute_after_preemption_is_not_counted_twice():
    rng = np.random.default_rng(1)
    rows = _ids(rng, 9)
    counts = ExpertCounts(LAYERS, EXPERTS)
    _add(counts, "r", "t", 0, 4, rows[:6])
    _add(counts, "r", "t", 0, 4, rows[:7])  # preempted, recomputed from position 0 with one more token
    _add(counts, "r", "t", 7, 4, rows[7:9])
    counts.finish("r")
    got = Observed.from_wire(counts.take(["t"])["t"])
    np.testing.assert_array_equal(got.prompt + got.decode, _brute(rows))
    assert (got.prompt_tokens, got.decode_tokens) == (4, 5)


def test_finished_counts_nobody_takes_are_bounded_oldest_first():
    counts = ExpertCounts(LAYERS, EXPERTS, keep=2)
    rows = _ids(np.random.default_rng(2), 1)
    for i in range(3):
        _add(counts, f"r{i}", f"t{i}", 0, 1, rows)
        counts.finish(f"r{i}")
    assert set(counts.take(["t0", "t1", "t2"])) == {"t1", "t2"}


def test_a_step_of_many_requests_counts_each_as_if_alone():
    """Several requests per forward (prefill chunks beside decode rows, one recomputed after a preemption, one
    whose rows were all counted before), counted in one call per step, against each request's own rows."""
    rng = np.random.default_rng(3)
    prompt = {"a": 5, "b": 2, "c": 3}
    tokens = {r: _ids(rng, 12) for r in prompt}  # every position's experts, per request
    steps = [  # per forward: (request, first position, rows)
        [("a", 0, 3), ("b", 0, 2)],
        [("a", 3, 3), ("b", 2, 1), ("c", 0, 4)],
        [("b", 0, 4), ("c", 4, 1)],  # b preempted and recomputed from 0 with one more token
        [("a", 6, 1), ("b", 4, 1), ("c", 0, 2)],  # c's rows were all counted before: nothing new
        [("a", 7, 1), ("c", 5, 1)],
    ]
    counts = ExpertCounts(LAYERS, EXPERTS)
    for step in steps:
        ids, spans = [], []
        for req, position, n in step:
            spans.append((req, f"t-{req}", position, prompt[req], len(ids), len(ids) + n))
            ids.extend(tokens[req][position:position + n])
        counts.add_step(spans, np.stack(ids))
    for req in prompt:
        counts.finish(req)
    seen = {"a": 8, "b": 5, "c": 6}  # positions counted, each once
    got = counts.take([f"t-{r}" for r in prompt])
    for req, n in seen.items():
        observed = Observed.from_wire(got[f"t-{req}"])
        p = prompt[req]
        assert np.array_equal(observed.prompt, _brute(tokens[req][:p])), req
        assert np.array_equal(observed.decode, _brute(tokens[req][p:n])), req
        assert (observed.prompt_tokens, observed.decode_tokens) == (p, n - p), req


def test_requests_that_come_and_go_over_many_steps_are_each_counted_as_if_alone():
    """40 requests arriving and finishing over 60 forwards (more live at once than the table's first rows, rows of
    finished requests reused by new ones, prefill chunks, recomputes), against a count of each request's own
    positions, each position once."""
    rng = np.random.default_rng(4)
    tokens = {f"r{i}": _ids(rng, 30) for i in range(40)}
    prompt = {r: int(rng.integers(1, 10)) for r in tokens}
    reached = dict.fromkeys(tokens, 0)  # positions the engine has computed, per request
    waiting, live, counts = list(tokens), [], ExpertCounts(LAYERS, EXPERTS)
    for _ in range(60):
        live += [waiting.pop(0) for _ in range(min(int(rng.integers(0, 4)), len(waiting)))]
        ids, spans = [], []
        for req in live:
            position = 0 if rng.random() < 0.05 else reached[req]  # preempted: recomputed from the start
            n = min(int(rng.integers(1, 5)) if position < prompt[req] else 1, 30 - position)
            spans.append((req, f"t-{req}", position, prompt[req], len(ids), len(ids) + n))
            ids.extend(tokens[req][position:position + n])
            reached[req] = max(reached[req], position + n)
        if spans:
            counts.add_step(spans, np.stack(ids))
        for req in [r for r in live if rng.random() < 0.1 or reached[r] == 30]:
            live.remove(req)
            counts.finish(req)
    for req in live:
        counts.finish(req)
    got = counts.take([f"t-{r}" for r in tokens])
    assert len(got) == sum(reached[r] > 0 for r in tokens) > 20
    for req, n in reached.items():
        if n:
            observed, p = Observed.from_wire(got[f"t-{req}"]), min(prompt[req], n)
            assert np.array_equal(observed.prompt, _brute(tokens[req][:p])), req
            assert np.array_equal(observed.decode, _brute(tokens[req][p:n])), req
            assert (observed.prompt_tokens, observed.decode_tokens) == (p, n - p), req
