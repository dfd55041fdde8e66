"""KV memory: the pools, block table, paged attention and its kernels, the prefix cache and its events."""
