"""Hashed word n-grams (encoder.ngrams) against a direct count."""

import zlib

import numpy as np

from moe_cohort.encoder.ngrams import hashed_ngrams


def test_rows_are_unit_log_counts_of_hashed_words_and_word_pairs():
    got = hashed_ngrams(["Hi, hi there", ""], dim=64)  # [2, 64]
    grams = ["hi", ",", "hi", "there", "hi ,", ", hi", "hi there"]
    want = np.zeros(64)
    for g in grams:
        want[zlib.crc32(g.encode()) % 64] += 1
    want = np.log1p(want)
    np.testing.assert_allclose(got[0], want / np.linalg.norm(want), rtol=1e-6)
    assert not got[1].any()  # an empty text is all zero
    np.testing.assert_array_equal(hashed_ngrams(["hi, HI there"], dim=64)[0], got[0])  # case-blind


def test_matches_the_direct_count_on_random_texts():
    """Each n-gram joined and hashed on its own, counted one by one: the same rows."""
    from moe_cohort.encoder.ngrams import _TOKEN

    rng = np.random.default_rng(0)
    vocab = ["the", "code", "def", "(", ")", ":", "x", "y", "rice", "é", "42", ",", "?"]
    texts = [" ".join(rng.choice(vocab, size=int(rng.integers(0, 30)))) for _ in range(50)]
    want = np.zeros((len(texts), 128))
    for i, text in enumerate(texts):
        words = _TOKEN.findall(text.lower())
        for n in (1, 2):
            for j in range(len(words) - n + 1):
                want[i, zlib.crc32(" ".join(words[j:j + n]).encode()) % 128] += 1
    want = np.log1p(want)
    want /= np.maximum(np.linalg.norm(want, axis=1, keepdims=True), 1e-12)
    np.testing.assert_allclose(hashed_ngrams(texts, dim=128), want, rtol=1e-6, atol=1e-7)


def test_the_columns_of_a_prompt_are_those_saved_heads_were_fitted_on():
    """Saved heads and learner reservoirs are indexed by these columns: the hash must not change under them."""
    row = hashed_ngrams(["Answer with one letter: A, B or C."], dim=4096)[0]
    assert np.flatnonzero(row).tolist() == [55, 68, 268, 526, 576, 578, 878, 1286, 1367, 1415, 1560, 1599, 1744,
                                            1777, 2597, 3128, 3408, 3594, 3651, 3951, 4089]
    np.testing.assert_allclose(row[row > 0], 1 / np.sqrt(21), rtol=1e-6)  # 21 distinct n-grams, each once
