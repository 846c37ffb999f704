"""Presets parse into configs with the published layer pattern and parameter counts."""

from __future__ import annotations

import pytest

from deltaserve.config.model_config import DENSE_MLP, SPARSE_MLP, KimiLinearConfig
from deltaserve.model_files.presets import PRESETS, count_parameters, preset_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_a_fixed_point_of_the_hub_spelling(name):
    config = preset_config(name)
    assert isinstance(config, KimiLinearConfig)
    assert config.to_hub_dict() == PRESETS[name]
    assert config.mlp_layer_types[0] == DENSE_MLP
    assert all(t == SPARSE_MLP for t in config.mlp_layer_types[1:])


def test_tiny_layout():
    c = preset_config("tiny")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (512, 64, 4)
    assert c.kda_layer_ids == [0, 1, 3] and c.mla_layer_ids == [2]
    assert (c.num_experts, c.num_experts_per_token, c.num_expert_group, c.topk_group) == (8, 2, 2, 1)
    assert c.q_lora_rank is None and c.torch_dtype == "float32"
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (256, (257,), 258)


def test_48b_matches_the_published_config():
    c = preset_config("kimi-linear-48b-a3b")
    assert len(c.kda_layer_ids) == 20 and len(c.mla_layer_ids) == 7
    assert [i + 1 for i in c.mla_layer_ids] == [4, 8, 12, 16, 20, 24, 27]
    published = PRESETS["kimi-linear-48b-a3b"]["linear_attn_config"]
    assert published["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
    assert len(published["kda_layers"]) == 20
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (256, 8, 1)
    assert (c.hidden_size, c.intermediate_size, c.moe_intermediate_size) == (2304, 9216, 1024)
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (512, 128, 64, 128)
    assert (c.linear_num_heads, c.linear_head_dim, c.short_conv_kernel_size) == (32, 128, 4)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (163584, (163586,), 163839)
    assert c.max_position_embeddings == 1048576 and c.torch_dtype == "bfloat16"
    total, active = count_parameters(c)
    assert 47e9 < total < 50e9, total
    assert 2.5e9 < active < 3.5e9, active


def test_small_is_about_one_billion():
    total, active = count_parameters(preset_config("small"))
    assert 0.8e9 < total < 1.3e9 and active < total / 3


def test_count_parameters_by_hand_on_tiny():
    c = preset_config("tiny")
    total, active = count_parameters(c)
    per_expert = 3 * 64 * 32
    assert total - active == 3 * (8 - 2) * per_expert + 512 * 64  # unrouted experts + embedding table


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"preset='huge'.*kimi-linear-48b-a3b.*small.*tiny"):
        preset_config("huge")


def test_48b_8l_has_the_48b_layers_and_fits_an_80gb_gpu():
    full, short = preset_config("kimi-linear-48b-a3b"), preset_config("kimi-linear-48b-a3b-8l")
    assert [i + 1 for i in short.mla_layer_ids] == [4, 8] and len(short.kda_layer_ids) == 6
    for field in ("hidden_size", "moe_intermediate_size", "num_experts", "kv_lora_rank", "linear_num_heads",
                  "linear_head_dim", "vocab_size"):
        assert getattr(short, field) == getattr(full, field), field
    total, _ = count_parameters(short)
    assert 2 * total < 32e9, total  # bfloat16 weights leave room for the cache on 80 GB
