"""benchmarks/bench_batch_learning's batch file and its rates (the figures are send.engine_counters', tested there);
benchmarks/bench_refit's timings."""

import math

from benchmarks.bench_batch_learning import batch_file, rates
from benchmarks.bench_refit import time_predict, time_refit
from moe_cohort.batch.format import read_batch_file
from moe_cohort.send.engine_counters import DecodeCounters


def test_the_batch_file_is_a_valid_openai_batch_of_the_prompts(tmp_path):
    path = batch_file(tmp_path / "in.jsonl", ["why?", "how?"], max_tokens=7)
    parsed = read_batch_file(path, default_policy="topk", max_line_bytes=10_000)
    assert not parsed.errors and [r.text for r in parsed.requests] == ["why?", "how?"]
    assert all(r.body["max_tokens"] == 7 and r.body["ignore_eos"] for r in parsed.requests)


def test_a_quarter_in_which_nothing_was_decoded_has_nan_rates():
    assert rates(DecodeCounters(loads=30, layer_forwards=8, tokens=4), layers=2) == (30 / 4, 4 * 2 / 8)
    assert all(math.isnan(x) for x in rates(DecodeCounters(), layers=2))


def test_a_refit_is_timed():
    texts = ["why is the sky blue", "sort a list in python", "a soup for winter"]
    assert 0 < time_refit(20, 2, 4, 2, 1, texts) < 60 and 0 < time_refit(20, 2, 4, 2, 1, texts, (1.0,)) < 60


def test_a_prediction_is_timed_against_the_dense_products():
    texts = [f"question {i}: how do I sort a list in python" for i in range(12)]
    t = time_predict(30, 2, 4, 2, texts)
    assert set(t) == {"ngrams", "predict", "dense products"} and all(0 < v < 1e6 for v in t.values())
