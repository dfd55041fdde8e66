"""Scheduling: continuous batching with chunked prefill, the admission policies, the cache simulator."""
