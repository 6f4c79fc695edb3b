"""The device side of the engine: worker, model runner and their per-request state."""
