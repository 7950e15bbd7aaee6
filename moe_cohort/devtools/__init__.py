"""Development tooling, never loaded by the engine or the proxy's request path: a tiny random MoE
model (`cohort make-tiny-moe`) and a helper that starts and stops a local vLLM server (tests,
benchmarks, and the embedded backend of `cohort serve` with no `--backend`).
"""
