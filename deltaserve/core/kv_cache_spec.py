"""Cache specs: what one unit of each cache kind holds and how many bytes it takes.

The engine sizes its caches from these alone; a new cache kind is a new spec, not a special case.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLALatentSpec:
    """Paged MLA cache: per token per layer the normalised latent plus the shared k_pe.

    block_size is the scheduler's block, in tokens. Under decode context parallelism a block's tokens
    are striped over the dcp_size ranks of a DCP group, so one rank stores block_size / dcp_size of
    them: bytes_per_block, the bytes of one rank, shrinks and the same memory holds dcp_size times
    the context.
    """

    block_size: int
    num_layers: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    dtype_bytes: int
    dcp_size: int = 1

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's latents over all its layers (on the one rank that stores it)."""
        return self.num_layers * self.latent_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one scheduler block takes on each rank."""
        return self.block_size // self.dcp_size * self.bytes_per_token

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class KDAStateSpec:
    """One request's whole KDA state: every KDA layer's conv window and fp32 recurrent state."""

    num_layers: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dim: int  # channels of the short convolution (q, k and v together)
    conv_window: int  # cached inputs per channel: short_conv_kernel_size - 1
    conv_dtype_bytes: int
    state_dtype_bytes: int = 4

    @property
    def conv_bytes_per_layer(self) -> int:
        return self.conv_dim * self.conv_window * self.conv_dtype_bytes

    @property
    def recurrent_bytes_per_layer(self) -> int:
        return self.num_heads * self.head_k_dim * self.head_v_dim * self.state_dtype_bytes

    @property
    def bytes_per_image(self) -> int:
        return self.num_layers * (self.conv_bytes_per_layer + self.recurrent_bytes_per_layer)
