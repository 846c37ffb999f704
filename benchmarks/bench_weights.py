"""The benchmarks' random weights without a checkpoint on disk: the hub-layout stream drawn tensor by
tensor from seeded generators (on the GPU or the CPU), fingerprints of a few tensors, and the copy of
the same stream into transformers' KimiLinearForCausalLM (its fused and stacked parameter names).
Used by benchmarks/h200_bench.py; unit-tested in tests/bench/test_h200_bench_helpers.py.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from deltaserve.config.model_config import DENSE_MLP, LINEAR_ATTENTION, KimiLinearConfig
from deltaserve.model_files.hub_layout import hub_tensor_shapes
from deltaserve.model_files.random_weights import iter_random_weights, random_tensor, tensor_seed


def seeded_weights(config: KimiLinearConfig, seed: int, dtype: torch.dtype, device: torch.device | str,
                   source: str = "device") -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, tensor on device) for every checkpoint tensor, each from its own seeded generator.

    source "device": drawn on `device` (a generator of that device seeded with tensor_seed(seed,
    name)); on the CPU this equals iter_random_weights. "cpu": iter_random_weights itself.
    """
    if source == "cpu":
        yield from iter_random_weights(config, seed, dtype, device)
        return
    if source != "device":
        raise ValueError(f"weights={source!r} is not known; choose device or cpu")
    dev = torch.device(device)
    for name, (shape, kind) in hub_tensor_shapes(config).items():
        gen = torch.Generator(device=dev).manual_seed(tensor_seed(seed, name))
        with torch.device(dev):  # random_tensor's draws allocate here, on the generator's device
            tensor = random_tensor(name, shape, kind, config, gen, dtype, dev)
        yield name, tensor


def fingerprinted(weights: Iterable[tuple[str, torch.Tensor]], config: KimiLinearConfig,
                  sink: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through, recording for a few tensors (embedding, lm_head, a KDA q_proj, an expert)
    the sha1 of their first 64k values' bits and their float64 sum."""
    moe = next(i for i, t in enumerate(config.mlp_layer_types) if t != DENSE_MLP)
    names = {"model.embed_tokens.weight", "lm_head.weight", f"model.layers.{moe}.block_sparse_moe.experts.0.w1.weight",
             f"model.layers.{config.kda_layer_ids[0]}.self_attn.q_proj.weight"}
    for name, tensor in weights:
        if name in names:
            head = tensor.reshape(-1)[:65536].contiguous().cpu().view(torch.uint8)
            sink[name] = [hashlib.sha1(head.numpy().tobytes()).hexdigest()[:16],
                          float(tensor.sum(dtype=torch.float64))]
        yield name, tensor


def hf_target(name: str, config: KimiLinearConfig) -> tuple[str, int | None, slice | None]:
    """Hub-layout tensor name -> (transformers KimiLinearForCausalLM parameter or buffer, expert index,
    row slice) that it fills. transformers fuses the q/k/v convs into self_attn.conv1d, nests the
    forget gate under self_attn.forget_gate, stacks experts into mlp.experts.gate_up_proj [E, 2I, d]
    ([w1; w3]) and mlp.experts.down_proj [E, d, I] (w2), and calls block_sparse_moe mlp."""
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if match is None:
        return name, None, None
    layer, rest = int(match.group(1)), match.group(2).replace("block_sparse_moe.", "mlp.", 1)
    prefix, conv = f"model.layers.{layer}.", re.match(r"^self_attn\.([qkv])_conv1d\.weight$", rest)
    if config.layer_types[layer] == LINEAR_ATTENTION and conv is not None:
        i, n = "qkv".index(conv.group(1)), config.kda_qkv_dim
        return prefix + "self_attn.conv1d.weight", None, slice(i * n, (i + 1) * n)
    if config.layer_types[layer] == LINEAR_ATTENTION and rest in (
            "self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight", "self_attn.A_log", "self_attn.dt_bias"):
        return prefix + rest.replace("self_attn.", "self_attn.forget_gate.", 1), None, None
    expert = re.match(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$", rest)
    if expert is None:
        return prefix + rest, None, None
    e, i, inter = int(expert.group(1)), "w1w3w2".index(expert.group(2)) // 2, config.moe_intermediate_size
    if i == 2:
        return prefix + "mlp.experts.down_proj", e, None
    return prefix + "mlp.experts.gate_up_proj", e, slice(i * inter, (i + 1) * inter)


@torch.no_grad()
def fill_hf_model(model: torch.nn.Module, config: KimiLinearConfig,
                  weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy a hub-layout stream into a transformers model; every parameter and buffer must be covered
    exactly once (ValueError naming the first that is not). Returns the number of values written."""
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    written = dict.fromkeys(targets, 0)
    for name, tensor in weights:
        hf_name, expert, rows = hf_target(name, config)
        if hf_name not in targets:
            raise ValueError(f"hub tensor {name!r} maps to {hf_name!r}, which transformers' model lacks")
        dst = targets[hf_name].data[expert if expert is not None else slice(None)][rows or slice(None)]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"hub tensor {name!r} {tuple(tensor.shape)} does not fit {hf_name!r} {tuple(dst.shape)}")
        dst.copy_(tensor)
        written[hf_name] += dst.numel()
    wrong = [f"{n} ({written[n]} of {t.numel()} values)" for n, t in targets.items() if written[n] != t.numel()]
    if wrong:
        raise ValueError(f"transformers tensors left incomplete: {', '.join(wrong[:3])} ({len(wrong)} in all)")
    return sum(written.values())
