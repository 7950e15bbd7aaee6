"""Batch files end to end: the OpenAI Batch format and its journal (resumable, every line once), the admission orders
of a file's lines, the local runner, probes, and the Ray and Ray Data LLM integrations."""
