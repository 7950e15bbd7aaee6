"""The vLLM server `cohort serve` starts when no --backend is given: the trained tiny MoE, where its processes run, and
the guard that takes them down with the proxy."""
