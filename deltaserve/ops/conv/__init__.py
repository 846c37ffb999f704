"""Depthwise causal short convolution (KDA's q/k/v conv) over packed sequences with pooled windows."""

from deltaserve.ops.conv.naive import causal_conv1d_decode, causal_conv1d_prefill

__all__ = ["causal_conv1d_decode", "causal_conv1d_prefill"]
