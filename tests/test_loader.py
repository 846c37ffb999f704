"""Checkpoint loading: both layouts, sharded files, and named errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_reference import build_hf_model, tiny_hub_config
from safetensors.torch import load_file, save_file

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.loader import load_model, load_model_from_dir
from deltaserve.model_files.make_model import make_model

CPU = torch.device("cpu")


def _load(model_dir: str):
    config = KimiLinearConfig.from_pretrained(model_dir)
    return load_model_from_dir(model_dir, config, ParallelConfig(), torch.float32, CPU)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf_layout"))
    build_hf_model(tiny_hub_config(), seed=3).save_pretrained(out)
    return out


def test_transformers_layout_loads_every_tensor(hf_dir):
    model = _load(hf_dir)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    # layer 0's dense MLP is stored under block_sparse_moe.* by save_pretrained
    assert any(k.startswith("model.layers.0.block_sparse_moe.gate_proj") for k in state)
    gate, up = model.layers["0"].mlp.gate_up_proj.weight.chunk(2)
    torch.testing.assert_close(gate, state["model.layers.0.block_sparse_moe.gate_proj.weight"])
    torch.testing.assert_close(up, state["model.layers.0.block_sparse_moe.up_proj.weight"])
    w13 = model.layers["1"].mlp.w13
    torch.testing.assert_close(w13[3, :32], state["model.layers.1.block_sparse_moe.experts.3.w1.weight"])
    torch.testing.assert_close(w13[3, 32:], state["model.layers.1.block_sparse_moe.experts.3.w3.weight"])
    conv = model.layers["0"].self_attn.qkv_conv_weight
    torch.testing.assert_close(conv[64:128], state["model.layers.0.self_attn.k_conv1d.weight"].squeeze(1))


def test_hub_layout_from_make_model_loads_sharded(tmp_path):
    out = make_model("tiny", str(tmp_path / "tiny"), seed=1, max_shard_bytes=200_000)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    model = _load(out)
    assert len(model.kda_layers()) + len(model.mla_layers()) == model.config.num_hidden_layers


def test_missing_tensor_is_named(hf_dir, tmp_path):
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    del state["model.layers.2.self_attn.kv_b_proj.weight"]
    config = KimiLinearConfig.from_pretrained(hf_dir)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        load_model(config, ParallelConfig(), torch.float32, CPU, state.items())


def test_unexpected_tensor_is_named(hf_dir):
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    state["model.layers.1.self_attn.mystery.weight"] = torch.randn(3)
    config = KimiLinearConfig.from_pretrained(hf_dir)
    with pytest.raises(ValueError, match=r"mystery"):
        load_model(config, ParallelConfig(), torch.float32, CPU, state.items())


def test_wrong_shape_is_named(hf_dir):
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    state["model.layers.0.self_attn.o_proj.weight"] = torch.randn(64, 63)
    config = KimiLinearConfig.from_pretrained(hf_dir)
    with pytest.raises(ValueError, match=r"o_proj"):
        load_model(config, ParallelConfig(), torch.float32, CPU, state.items())


def test_unreadable_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        _load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(tiny_hub_config()))
    with pytest.raises(ValueError, match="safetensors"):
        _load(str(tmp_path))
    save_file({"x": torch.randn(2)}, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError):
        _load(str(tmp_path))


def test_config_reads_both_spellings(hf_dir):
    published = KimiLinearConfig.from_dict(tiny_hub_config())
    with open(os.path.join(hf_dir, "config.json")) as f:
        written = json.load(f)
    written.pop("linear_attn_config", None)  # keep only transformers' own spelling
    assert "layer_types" in written and "mlp_layer_types" in written
    ours = KimiLinearConfig.from_dict(written)
    assert ours.layer_types == published.layer_types
    assert ours.mlp_layer_types == published.mlp_layer_types
    assert ours.num_experts == published.num_experts and ours.linear_num_heads == published.linear_num_heads
