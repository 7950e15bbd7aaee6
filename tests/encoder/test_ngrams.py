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
