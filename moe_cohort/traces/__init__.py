"""Expert traces: their file format, importers of public traces, merging, the held-out split, and what the engine's
counts say of a request."""
