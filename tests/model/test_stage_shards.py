"""Per-rank shards and per-stage models load the right slices of one checkpoint (no process groups:
building and loading a shard needs none; tests/distributed runs them)."""

from __future__ import annotations

import os

import pytest
import torch
from hf_reference import checkpoint_dir, tiny_hub_config
from safetensors.torch import load_file, save_file

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.loader import load_model_from_dir

CPU = torch.device("cpu")


def _load(model_dir: str, **parallel):
    config = KimiLinearConfig.from_pretrained(model_dir)
    return load_model_from_dir(model_dir, config, ParallelConfig(**parallel), torch.float32, CPU)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return checkpoint_dir(tmp_path_factory, "shards", tiny_hub_config(), seed=41)[0]


def test_tensor_parallel_shards_reassemble_the_full_weights(model_dir):
    full = dict(_load(model_dir).named_parameters())
    ranks = [dict(_load(model_dir, tensor_parallel_size=2, tensor_parallel_rank=r).named_parameters())
             for r in range(2)]
    # name -> dim the shards split (None: replicated)
    splits = {
        "layers.0.self_attn.o_proj.weight": 1,  # KDA, row-split
        "layers.0.self_attn.b_proj.weight": 0,  # column-split by head
        "layers.0.self_attn.A_log": 2,
        "layers.0.self_attn.dt_bias": 0,
        "layers.0.self_attn.f_a_proj.weight": None,
        "layers.0.mlp.down_proj.weight": 1,
        "layers.2.self_attn.kv_b_proj.weight": 0,  # MLA
        "layers.2.self_attn.o_proj.weight": 1,
        "layers.2.self_attn.kv_a_proj_with_mqa.weight": None,
        "layers.2.mlp.w2": 2,  # experts split along their intermediate size
        "layers.2.mlp.gate_weight": None,
        "embed_tokens.weight": None,
        "lm_head.weight": None,
    }
    for name, dim in splits.items():
        if dim is None:
            assert all(torch.equal(r[name], full[name]) for r in ranks), name
        else:
            assert torch.equal(torch.cat([r[name] for r in ranks], dim), full[name]), name
    # fused pieces: each rank holds its half of q, of k and of v, in that order
    q, k, v = full["layers.1.self_attn.qkv_proj.weight"].chunk(3)
    for r, shard in enumerate(ranks):
        halves = [t.chunk(2)[r] for t in (q, k, v)]
        assert torch.equal(shard["layers.1.self_attn.qkv_proj.weight"], torch.cat(halves)), r


def test_pipeline_stages_split_the_layers(model_dir):
    first = _load(model_dir, pipeline_parallel_size=2, pipeline_parallel_rank=0)
    last = _load(model_dir, pipeline_parallel_size=2, pipeline_parallel_rank=1)
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.embed_tokens is not None and not hasattr(first, "lm_head")
    assert last.embed_tokens is None and hasattr(last, "lm_head")


def test_tied_lm_head_on_a_last_stage_without_the_embedding(tmp_path_factory):
    tied = checkpoint_dir(tmp_path_factory, "tied", tiny_hub_config(tie_word_embeddings=True), seed=42)[0]
    # a tied checkpoint need not store lm_head (the hub layout omits it): the last stage must copy the embedding
    path = os.path.join(tied, "model.safetensors")
    tensors = load_file(path)
    del tensors["lm_head.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    first = _load(tied, pipeline_parallel_size=2, pipeline_parallel_rank=0)
    last = _load(tied, pipeline_parallel_size=2, pipeline_parallel_rank=1)
    assert torch.equal(last.lm_head.weight, first.embed_tokens.weight)
