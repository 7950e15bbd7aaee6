"""proxy/profiles.py: the serving process's encoder threads."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_limit_threads_caps_torch_the_blas_and_the_tokenizer():
    # a process of its own: the limits are process-wide; before them torch and the BLAS use every core
    code = ("import os, torch, numpy; from threadpoolctl import threadpool_info; from proxy.profiles import limit_threads; "
            "limit_threads(1); print(torch.get_num_threads(), max(i['num_threads'] for i in threadpool_info()), "
            "os.environ['TOKENIZERS_PARALLELISM'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["1", "1", "false"]
