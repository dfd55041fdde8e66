"""Sampling: the sampler, grammars (structured outputs) and MTP speculative decoding."""
