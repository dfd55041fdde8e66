"""Across engines: prefill/decode disaggregation, KV transports and the KV-affinity router."""
