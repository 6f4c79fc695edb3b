"""The engine's plain-Python core: requests, KV block bookkeeping and the scheduler (no torch)."""
