"""make_model writes a checkpoint transformers loads cleanly; random weights; the embedded model."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from deltaserve.model_files import embedded
from deltaserve.model_files.checkpoint_io import INDEX_FILE, iter_checkpoint_tensors
from deltaserve.model_files.hub_layout import FLOAT32, hub_tensor_shapes
from deltaserve.model_files.make_model import build_random_state_dict, make_model
from deltaserve.model_files.presets import preset_config
from deltaserve.model_files.random_weights import iter_random_weights, random_tensor, tensor_seed


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model("tiny", str(tmp_path_factory.mktemp("made") / "tiny"), seed=3)


def test_make_model_writes_config_weights_tokenizer(tiny_dir):
    assert os.path.isabs(tiny_dir)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(tiny_dir, f)), f
    with open(os.path.join(tiny_dir, "config.json")) as f:
        assert json.load(f) == preset_config("tiny").to_hub_dict()
    config = preset_config("tiny")
    on_disk = dict(iter_checkpoint_tensors(tiny_dir))
    expected = build_random_state_dict(config, seed=3)
    assert on_disk.keys() == expected.keys() == hub_tensor_shapes(config).keys()
    assert all(torch.equal(on_disk[k], expected[k]) for k in expected)


def test_transformers_loads_a_made_checkpoint_with_no_missing_keys(tiny_dir):
    from transformers import AutoTokenizer, KimiLinearForCausalLM

    model, info = KimiLinearForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    ids = tok("Hello, world", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(set(out)) > 3, f"a random model should not repeat one token: {out}"


def test_bf16_sharded_make_model_loads_in_transformers(tmp_path):
    from transformers import KimiLinearForCausalLM

    out = make_model("tiny", str(tmp_path / "bf16"), seed=0, dtype="bfloat16", max_shard_bytes=50_000)
    assert os.path.isfile(os.path.join(out, INDEX_FILE))
    model, info = KimiLinearForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.forget_gate.dt_bias.dtype == torch.float32


def test_random_weights_are_deterministic_per_seed_and_name():
    config = preset_config("tiny")
    a = build_random_state_dict(config, seed=7)
    b = build_random_state_dict(config, seed=7)
    c = build_random_state_dict(config, seed=8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    drawn = [k for k in a if not k.endswith("norm.weight")]
    assert all(not torch.equal(a[k], c[k]) for k in drawn)
    # one tensor alone, from its own generator, equals the same tensor of the whole model
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    shape, kind = hub_tensor_shapes(config)[name]
    gen = torch.Generator().manual_seed(tensor_seed(7, name))
    assert torch.equal(random_tensor(name, shape, kind, config, gen, torch.float32, "cpu"), a[name])
    # the same values whatever the thread count
    d = dict(iter_random_weights(config, seed=7, num_threads=1))
    assert all(torch.equal(a[k], d[k]) for k in a)


def test_random_weight_init():
    config = preset_config("tiny")
    w = build_random_state_dict(config, seed=1, dtype=torch.bfloat16)
    kinds = hub_tensor_shapes(config)
    for name, t in w.items():
        assert t.dtype == (torch.float32 if kinds[name][1] == FLOAT32 else torch.bfloat16), name
        assert torch.isfinite(t.float()).all(), name
        assert tuple(t.shape) == kinds[name][0], name
    a = torch.exp(w["model.layers.0.self_attn.A_log"].float())
    assert a.min() >= 1.0 - 1e-2 and a.max() <= 16.0 + 1e-1
    dt = torch.nn.functional.softplus(w["model.layers.0.self_attn.dt_bias"])
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    assert torch.equal(w["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert torch.equal(w["model.layers.0.self_attn.o_norm.weight"], torch.ones(16, dtype=torch.bfloat16))
    bias = w["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert 0 < bias.std() < 0.05
    emb = w["model.embed_tokens.weight"].float()
    assert math.isclose(emb.std().item(), 0.02, rel_tol=0.1)
    conv = w["model.layers.0.self_attn.q_conv1d.weight"].float()
    assert math.isclose(conv.std().item(), 0.2, rel_tol=0.15)


def test_make_model_errors_are_named(tmp_path):
    with pytest.raises(ValueError, match="preset='huge'"):
        make_model("huge", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="dtype='int8'"):
        make_model("tiny", str(tmp_path / "x"), dtype="int8")


def test_embedded_model_dir_is_made_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path / "cache"))
    calls = []
    real = embedded.make_model

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(embedded, "make_model", counting)
    first = embedded.embedded_model_dir(seed=2)
    assert first == str(tmp_path / "cache" / "tiny-seed2")
    assert os.path.isfile(os.path.join(first, "config.json"))
    assert embedded.embedded_model_dir(seed=2) == first
    assert len(calls) == 1
    assert sorted(os.listdir(tmp_path / "cache")) == ["tiny-seed2"]  # no temporary directory left


def test_embedded_model_dir_survives_losing_the_race(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path))
    real = embedded.make_model

    def other_process_wins(preset, out_dir, seed=0):
        real(preset, out_dir, seed=seed)
        real(preset, str(tmp_path / f"tiny-seed{seed}"), seed=seed)  # the rival renamed first

    monkeypatch.setattr(embedded, "make_model", other_process_wins)
    path = embedded.embedded_model_dir(seed=0)
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    assert os.listdir(tmp_path) == ["tiny-seed0"]
