"""RMS norms: the plain one (layer norms, latent norms) and the sigmoid-gated KDA output norm."""

from deltaserve.ops.norm.naive import gated_rms_norm, rms_norm

__all__ = ["gated_rms_norm", "rms_norm"]
