#!/usr/bin/env bash
# Create .venv and install moe-cohort into it.  Usage: bash scripts/setup.sh [EXTRA]   (EXTRA: cpu (default) or dev)
# Pins this machine's CPU build of torch (2.13.0); see pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-cpu}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[${extra}]"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers/vLLM imports
# beside the CPU torch; nothing here needs them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "moe-cohort installed in .venv (extra: ${extra})"
