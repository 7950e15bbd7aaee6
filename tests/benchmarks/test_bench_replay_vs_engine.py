"""benchmarks.bench_replay_vs_engine's replay rows, and record_traces' matching of a cut prompt, on small inputs."""

from __future__ import annotations

import numpy as np

from benchmarks.bench_replay_vs_engine import replay_rows
from benchmarks.record_traces import _match
from moe_cohort.eval.policies import by_profile, fixed_order
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from tests.conftest import random_traces


def _rows(ts):
    tok = decode_tokens(ts)
    return tok, {"fcfs": fixed_order(np.arange(len(ts))), "reference": by_profile(decode_profiles(tok, ts))}


def test_the_rows_replay_the_given_order_with_the_given_clients():
    ts = random_traces(40, num_experts=12, top_k=2, max_prompt=0, max_decode=9, seed=2)
    tok, rows = _rows(ts)
    ts_rows = replay_rows(ts, rows, 3, 6, orders=2)
    for name, policy in rows.items():
        want = policy.run(tok, tok.cycle, 3, clients=6).loads_per_token  # the e2e order: trace order
        assert ts_rows[name]["loads_per_token"] == want and len(ts_rows[name]["saving_others"]) == 2
    assert ts_rows["fcfs"]["saving"] == 0.0 and ts_rows["reference"]["saving"] > 0
    everyone = replay_rows(ts, rows, 3, None, orders=0)["reference"]["saving"]
    assert everyone > ts_rows["reference"]["saving"]  # the whole pool to choose from, not 3 waiting


def test_with_no_more_clients_than_slots_nothing_is_left_to_choose():
    ts = random_traces(30, num_experts=12, top_k=2, max_prompt=0, max_decode=9, seed=5)
    _, rows = _rows(ts)
    got = replay_rows(ts, rows, 4, 4, orders=3)
    assert got["reference"]["saving"] == 0.0 and got["reference"]["saving_others"] == [0.0, 0.0, 0.0]


def test_a_prompt_cut_to_its_last_tokens_finds_its_row():
    long_text = "word " * 400
    rows = {f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n": {"id": i}
            for i, t in enumerate(["short", long_text, "other " * 300])}
    full = next(iter(k for k, v in rows.items() if v["id"] == 1))
    assert _match(rows, full)["id"] == 1
    assert _match(rows, full[-900:])["id"] == 1  # what the recorder decodes of a prompt cut to its last tokens
    assert _match(rows, "nothing like it " * 10) is None
    assert _match(rows, "assistant\n") is None  # too short an ending to tell prompts apart


def test_every_saved_head_is_replayed_as_it_predicts(tmp_path):
    from benchmarks.bench_replay_vs_engine import saved_heads
    from moe_cohort.train.profile_head import fit_profile_head

    ts = random_traces(30, num_experts=12, top_k=2, max_prompt=0, max_decode=9, seed=4)
    tok = decode_tokens(ts)
    x = np.random.default_rng(4).normal(size=(30, 5)).astype(np.float32)
    texts = [f"prompt number {i}" for i in range(30)]
    head = fit_profile_head(x, decode_profiles(tok, ts), 2, texts=texts)
    head.save(tmp_path / "run" / "learned")
    policies = saved_heads(str(tmp_path), x, texts)
    assert list(policies) == ["run/learned"]
    want = by_profile(head.predict(x, texts)).run(tok, tok.cycle, 3, clients=6)
    assert policies["run/learned"].run(tok, tok.cycle, 3, clients=6).order.tolist() == want.order.tolist()
