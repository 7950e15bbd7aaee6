"""Without a GPU, the Triton kernels run in Triton's CPU interpreter: it must be switched on before
the kernels are defined (`backend.selection.triton_kernels` is imported lazily, on first use)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
