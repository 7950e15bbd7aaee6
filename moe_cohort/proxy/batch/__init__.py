"""The Batch API of the proxy (/v1/files, /v1/batches): stored files, jobs that run on the proxy's slots, and their
resumption."""
