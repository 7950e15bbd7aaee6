"""PromptRouting: each prompt's expert fractions, counted over its prefill chunks, against a brute-force count."""

import numpy as np

from moe_cohort.engine.prompt_routing import PromptRouting

L, E, K = 3, 8, 2


def brute_force(ids_of_prompt):
    """[P, L, K] ids of every computed prompt token -> [L, E] fraction of them that picked each expert."""
    out = np.zeros((L, E))
    for token in ids_of_prompt:
        for layer in range(L):
            for e in token[layer]:
                out[layer, e] += 1
    return out / len(ids_of_prompt)


def test_chunked_prefills_mixed_with_decodes_give_each_prompt_its_own_fractions_once_its_last_chunk_ran():
    rng = np.random.default_rng(0)
    prompts = {"a": 7, "b": 5, "c": 3}  # prompt tokens
    tokens = {rid: np.argsort(rng.random((n + 4, L, E)), axis=-1)[..., :K] for rid, n in prompts.items()}  # [n+4, L, K]
    routing = PromptRouting(L, E)
    # forward 1: a[0:4] (chunk), c[0:3] (whole prompt); forward 2: a[4:7], b[0:5], c decodes at 3
    forwards = [[("a", 0, 4), ("c", 0, 3)], [("a", 4, 3), ("b", 0, 5), ("c", 3, 1)]]
    taken = []
    for spans in forwards:
        rows, table = 0, []
        for rid, position, length in spans:
            table.append((rid, position, prompts[rid], rows, rows + length))
            rows += length
        ids = np.concatenate([tokens[rid][pos:pos + n] for rid, pos, n in spans])  # [n, L, K]
        routing.add_step(table, ids)
        taken.append(routing.take())
    assert list(taken[0]) == ["c"] and sorted(taken[1]) == ["a", "b"]  # handed over when the prompt ends, once
    for done in taken:
        for rid, profile in done.items():
            np.testing.assert_allclose(profile, brute_force(tokens[rid][:prompts[rid]]), rtol=1e-6)
    assert routing.take() == {}


def test_a_prefill_recomputed_after_a_preemption_is_counted_afresh_and_a_finished_one_is_dropped():
    ids = np.zeros((4, L, K), np.int64)
    ids[..., 1] = 1
    routing = PromptRouting(L, E)
    routing.add_step([("a", 0, 6, 0, 4)], ids)  # 4 of 6 prompt tokens, then preempted
    routing.add_step([("a", 0, 6, 0, 4)], ids + 2)  # recomputed from 0 ...
    routing.add_step([("a", 4, 6, 0, 2)], ids[:2] + 2)  # ... to the end
    profile = routing.take()["a"]
    assert profile[0, 2] == 1.0 and profile[0, 0] == 0.0  # nothing of the first attempt is left
    routing.add_step([("b", 0, 6, 0, 4)], ids)
    routing.add_step([("c", 0, 2, 0, 2)], ids[:2])
    routing.finish("b"), routing.finish("c")  # aborted in its prefill; left before its routing was taken
    assert routing.take() == {} and routing._counts == {}
