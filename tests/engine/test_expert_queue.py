"""ExpertAwareQueue: vLLM's request-queue contract, and admission by predicted experts (no vLLM needed)."""

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

from moe_cohort.admission.wire import COMPACT_TOP, compact, decode_profile
from moe_cohort.engine.expert_queue import ExpertAwareQueue

E = COMPACT_TOP + 4  # experts per layer in these tests

_ids = itertools.count()


def req(profile=None, arrival=0.0, raw=None):
    """A duck-typed vLLM request; `profile` [L, E] frequencies in 0..1 (sent in compact form), `raw` sent as is."""
    sent = raw if raw is not None else None if profile is None else compact(np.asarray(profile).reshape(-1, E))
    extra = {} if sent is None else {"moe_profile": sent}
    return SimpleNamespace(request_id=f"q{next(_ids)}", arrival_time=arrival,
                           sampling_params=SimpleNamespace(extra_args=extra))


def queue(running=(), max_wait_s=100.0, now=(0.0,)):
    return ExpertAwareQueue(lambda: list(running), E, max_wait_s=max_wait_s, clock=lambda: now[0])


def one_hot(*experts, layers=1):
    """[L, E] profile that uses `experts` in every layer."""
    u = np.zeros((layers, E))
    u[:, list(experts)] = 1.0
    return u


def brute_force_best(running, candidates):
    """Expected new experts per step, term by term: sum_{l,e} u_c[l,e] * prod_r (1 - u_r[l,e])."""
    def cost(c):
        total = 0.0
        for j, u in enumerate(decode_profile(c.sampling_params.extra_args["moe_profile"], E)):
            idle = 1.0
            for r in running:
                idle *= 1.0 - min(decode_profile(r.sampling_params.extra_args["moe_profile"], E)[j], 0.999)
            total += u * idle
        return total
    return min(candidates, key=cost) if running else candidates[0]  # nobody to fit: the oldest


def test_without_profiles_it_behaves_like_vllms_fcfs_queue():
    vllm_queue = pytest.importorskip("vllm.v1.core.sched.request_queue")
    ours, theirs, rng = queue(), vllm_queue.FCFSRequestQueue(), random.Random(0)
    for _ in range(300):
        op = rng.choice(["add", "add", "pop", "prepend", "prepend_many", "remove"])
        if op == "add" or (op != "prepend_many" and not theirs):
            r = req()
            ours.add_request(r), theirs.add_request(r)
        elif op == "pop":
            assert ours.pop_request() is theirs.pop_request()
        elif op == "prepend":
            r = req()
            ours.prepend_request(r), theirs.prepend_request(r)
        elif op == "prepend_many":
            rs = [req() for _ in range(rng.randint(0, 3))]
            ours.prepend_requests(rs), theirs.prepend_requests(rs)
        else:
            r = rng.choice(list(theirs))
            ours.remove_request(r), theirs.remove_request(r)
        assert list(ours) == list(theirs) and len(ours) == len(theirs) and bool(ours) == bool(theirs)
        if theirs:
            assert ours.peek_request() is theirs.peek_request()


def test_admits_the_candidate_with_fewest_expected_new_experts():
    rng = np.random.default_rng(3)
    for _ in range(20):
        running = [req(rng.dirichlet(np.full(E, 0.3), size=2) * 3) for _ in range(rng.integers(0, 4))]
        candidates = [req(rng.dirichlet(np.full(E, 0.3), size=2) * 3) for _ in range(6)]
        q = queue(running)
        for c in candidates:
            q.add_request(c)
        expected = brute_force_best(running, candidates)
        assert q.peek_request() is expected and q.pop_request() is expected and len(q) == 5


def test_the_running_set_steers_the_choice():
    a, b = one_hot(0, 1), one_hot(2, 3)
    running = [req(a)]
    q = queue(running)
    like_b, like_a = req(b), req(a)
    q.add_request(like_b), q.add_request(like_a)  # arrival order would take like_b
    assert q.pop_request() is like_a
    running[:] = [req(b)]
    q.add_request(like_a2 := req(a))
    assert q.pop_request() is like_b and q.pop_request() is like_a2


def test_a_request_without_profile_is_never_overtaken():
    running = [req(one_hot(0))]
    q = queue(running)
    early, plain, late = req(one_hot(1)), req(), req(one_hot(0))
    for r in (early, plain, late):
        q.add_request(r)
    assert [q.pop_request() for _ in range(3)] == [early, plain, late]


def test_malformed_profiles_keep_first_come_first_served():
    q = queue([req(one_hot(0))])
    bad, good = req(raw=[1, 999]), req(one_hot(0))
    q.add_request(bad), q.add_request(good)
    assert q.pop_request() is bad


def test_a_null_profile_is_no_profile_and_no_warning(caplog):
    """A Ray Dataset fills a key some rows lack with null: such a request is one without a profile."""
    from moe_cohort.engine.expert_queue import profile_of

    with caplog.at_level("WARNING"):
        assert profile_of(req(raw=None), E) is None
        nulled = req()
        nulled.sampling_params.extra_args = {"moe_profile": None}
        assert profile_of(nulled, E) is None
    assert not caplog.records
    with caplog.at_level("WARNING"):
        assert profile_of(req(raw=[1, 999]), E) is None
    assert "moe_profile must be a list" in caplog.text


def test_fairness_bound_puts_the_oldest_overdue_request_first():
    now = [8.0]
    running = [req(one_hot(0))]
    q = queue(running, max_wait_s=5.0, now=now)
    old_misfit, fit = req(one_hot(1), arrival=4.0), req(one_hot(0), arrival=7.0)
    q.add_request(old_misfit), q.add_request(fit)
    assert q.peek_request() is fit  # old_misfit has waited 4 s
    now[0] = 9.0  # ... now 5 s: it goes first, although it fits worse
    assert q.peek_request() is old_misfit


def test_pop_returns_what_peek_showed_even_if_a_deadline_passes_in_between():
    now = [0.0]
    running = [req(one_hot(0))]
    q = queue(running, max_wait_s=5.0, now=now)
    misfit, fit = req(one_hot(1), arrival=0.0), req(one_hot(0), arrival=0.0)
    q.add_request(misfit), q.add_request(fit)
    assert q.peek_request() is fit
    now[0] = 6.0  # both overdue now; the scheduler already checked `fit`
    assert q.pop_request() is fit


def test_removing_an_absent_request_is_an_error():
    q = queue()
    with pytest.raises(ValueError, match="not in the queue"):
        q.remove_request(req())
    with pytest.raises(IndexError):
        q.peek_request()
