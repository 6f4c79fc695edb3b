"""Multi-LoRA serving: adapter requests, PEFT adapter loading, resident adapter slots and the per-token LoRA delta.

Only `request` is plain Python (it travels in EngineCoreRequest, which engine/core reads); the other
modules import torch and are used by the worker.
"""
