"""Sampling: logits + per-row parameters -> token ids and logprobs."""

from deltaserve.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, step_seed

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "step_seed"]
