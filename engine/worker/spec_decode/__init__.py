"""Speculative decoding: speculators propose tokens, verify.py accepts the prefix the model would have sampled."""
