import json
import subprocess
import sys

HEAVY = ["torch", "sentence_transformers", "transformers", "vllm", "httpx", "fastapi", "starlette", "aiohttp", "requests"]


def test_planner_modules_stay_pure():
    """Planning needs numpy and FAISS only: no torch, no web framework, no HTTP client, no vLLM."""
    code = ("import sys, json; import encoder, encoder.planner, encoder.baselines, encoder.inputs, encoder.text, "
            "encoder.cli; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in %r)))" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
