"""Templated prompts: deterministic by seed, every kind in turn, each kind in words of its own."""

from moe_cohort.devtools.templated_prompts import KINDS, templated_prompts


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others():
    assert templated_prompts(20, seed=3) == templated_prompts(20, seed=3)
    assert templated_prompts(20, seed=3) != templated_prompts(20, seed=4)


def test_kinds_take_turns_and_every_template_is_filled():
    prompts = templated_prompts(25)
    assert len(prompts) == 25 * len(KINDS)
    assert [k for k, _ in prompts[: len(KINDS)]] == list(KINDS)
    assert all("{" not in text and "}" not in text for _, text in prompts)


def test_each_kind_has_words_the_others_rarely_use():
    words = {k: set() for k in KINDS}
    for kind, text in templated_prompts(100):
        words[kind] |= {w.strip(".,?;:").lower() for w in text.split() if len(w) > 4}
    for kind in KINDS:
        others = set().union(*(words[k] for k in KINDS if k != kind))
        assert len(words[kind] - others) > len(words[kind]) / 2, kind
