"""backend.server: a vLLM server that cannot start is reported with its log, and nothing is left running."""

import importlib.util

import psutil
import pytest

from backend.server import ServerError, free_port, start

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    model, log_path = tmp_path / "no-such-model", tmp_path / "vllm.log"
    with pytest.raises(ServerError) as info:
        start(model, port=free_port(), log_path=log_path, timeout=120)
    message = str(info.value)
    assert "exited with code" in message and str(log_path) in message
    assert "no-such-model" in message  # the tail of vLLM's own error is quoted
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(model) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers
