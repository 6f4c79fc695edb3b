"""The sampler: batched logits processing, seeded sampling and logprobs for the model runner."""

from engine.sample.logprobs import LogprobsTensors, gather_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.random_sampling import make_generator
from engine.sample.sampler import Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "gather_logprobs", "make_generator"]
