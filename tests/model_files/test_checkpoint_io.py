"""The hub layout against what transformers writes; checkpoint reading and writing; named errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.config.model_config import DENSE_MLP, KimiLinearConfig
from deltaserve.model_files.checkpoint_io import (
    INDEX_FILE,
    iter_checkpoint_tensors,
    list_checkpoint_files,
    write_checkpoint,
)
from deltaserve.model_files.hub_layout import FLOAT32, MODEL_DTYPE, hub_tensor_shapes
from deltaserve.model_files.presets import PRESETS
from deltaserve.model_files.random_weights import iter_random_weights


def _config(**overrides) -> KimiLinearConfig:
    return KimiLinearConfig.from_dict({**PRESETS["tiny"], **overrides})


def _transformers_save(config: KimiLinearConfig, out_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """What KimiLinearForCausalLM(config).save_pretrained writes: name -> (shape, safetensors dtype)."""
    from transformers import KimiLinearConfig as HFConfig
    from transformers import KimiLinearForCausalLM

    kwargs = {k: v for k, v in config.to_hub_dict().items() if k not in ("architectures", "model_type")}
    model = KimiLinearForCausalLM._from_config(HFConfig(**kwargs), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    written = {}
    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            written[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return written


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": 24, "num_expert_group": 1, "num_shared_experts": 2}],
    ids=["tiny", "q_lora"],
)
def test_hub_layout_matches_transformers_save_pretrained(overrides, tmp_path):
    config = _config(**overrides)
    written = _transformers_save(config, str(tmp_path))
    dense = {i for i, t in enumerate(config.mlp_layer_types) if t == DENSE_MLP}
    # transformers renames every `.mlp.` to `.block_sparse_moe.` on save, the dense MLP's too
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in written
    canonical = {}
    for name, value in written.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) in dense:
            name = name.replace(".block_sparse_moe.", ".mlp.")
        canonical[name] = value
    ours = hub_tensor_shapes(config)
    assert sorted(ours) == sorted(canonical)
    for name, (shape, kind) in ours.items():
        assert canonical[name][0] == shape, name
        assert canonical[name][1] == ("F32" if kind == FLOAT32 else "BF16"), name
    fp32 = sorted({".".join(n.split(".")[-2:]) for n, (_, k) in ours.items() if k == FLOAT32})
    assert fp32 == ["gate.e_score_correction_bias", "gate.weight", "self_attn.dt_bias"]


def test_hub_layout_without_lm_head_when_tied():
    shapes = hub_tensor_shapes(_config(tie_word_embeddings=True))
    assert "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes
    assert all(kind in (MODEL_DTYPE, FLOAT32) for _, kind in shapes.values())


def _weights(config, seed=0):
    return dict(iter_random_weights(config, seed))


def test_single_file_round_trip(tmp_path):
    config = _config()
    weights = _weights(config)
    files = write_checkpoint(str(tmp_path), config, weights.items())
    assert files == [str(tmp_path / "model.safetensors")]
    assert list_checkpoint_files(str(tmp_path)) == files
    assert not (tmp_path / INDEX_FILE).exists()
    back = dict(iter_checkpoint_tensors(str(tmp_path), progress=False))
    assert back.keys() == weights.keys()
    for name, t in weights.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert KimiLinearConfig.from_pretrained(str(tmp_path)) == config
    with open(tmp_path / "generation_config.json") as f:
        assert json.load(f) == {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}


def test_sharded_round_trip_and_index(tmp_path):
    config = _config()
    weights = _weights(config, seed=5)
    max_bytes = 60_000
    files = write_checkpoint(str(tmp_path), config, weights.items(), max_shard_bytes=max_bytes)
    n = len(files)
    assert n > 3
    names = [os.path.basename(f) for f in files]
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / "model.safetensors").exists()
    with open(tmp_path / INDEX_FILE) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    for path in files:
        with safe_open(path, "pt") as f:
            names = list(f.keys())
        assert all(index["weight_map"][k] == os.path.basename(path) for k in names)
        size = sum(weights[k].numel() * weights[k].element_size() for k in names)
        assert size <= max_bytes or len(names) == 1
    assert list_checkpoint_files(str(tmp_path)) == files
    back = dict(iter_checkpoint_tensors(str(tmp_path), progress=True))
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)

    # rewriting as one file leaves no stale shards or index behind
    write_checkpoint(str(tmp_path), config, weights.items())
    assert sorted(p for p in os.listdir(tmp_path) if "safetensors" in p) == ["model.safetensors"]


def test_write_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    import safetensors.torch

    config = _config()
    weights = _weights(config)
    held = []
    real = safetensors.torch.save_file
    def counting_save(d, *args, **kwargs):
        held.append(len(d))
        return real(d, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", counting_save)
    write_checkpoint(str(tmp_path), config, weights.items(), max_shard_bytes=100_000)
    assert sum(held) == len(weights) and len(held) > 1


def test_glob_fallback_and_duplicate_names(tmp_path):
    save_file({"b": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    save_file({"a": torch.zeros(3)}, str(tmp_path / "a.safetensors"))
    files = list_checkpoint_files(str(tmp_path))
    assert [os.path.basename(p) for p in files] == ["a.safetensors", "b.safetensors"]
    assert [n for n, _ in iter_checkpoint_tensors(str(tmp_path))] == ["a", "b"]
    with pytest.raises(ValueError, match="'x' was given twice"):
        write_checkpoint(str(tmp_path / "out"), _config(), [("x", torch.ones(1)), ("x", torch.ones(1))])


def test_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="nowhere.*is not a directory"):
        list_checkpoint_files(missing)
    with pytest.raises(ValueError, match="is not a directory"):
        iter_checkpoint_tensors(missing)  # raised at the call, before iterating
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in .*empty"):
        list_checkpoint_files(str(empty))

    sharded = tmp_path / "sharded"
    config = _config()
    files = write_checkpoint(str(sharded), config, _weights(config).items(), max_shard_bytes=100_000)
    os.remove(files[1])
    with pytest.raises(ValueError, match=rf"names shard '{os.path.basename(files[1])}', which is missing"):
        list_checkpoint_files(str(sharded))

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    save_file({"x": torch.randn(64)}, str(corrupt / "model.safetensors"))
    with open(corrupt / "model.safetensors", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError, match=r"corrupt.model\.safetensors is not a readable safetensors file"):
        list(iter_checkpoint_tensors(str(corrupt)))

    lying = tmp_path / "lying"
    lying.mkdir()
    save_file({"x": torch.randn(4)}, str(lying / "model-00001-of-00001.safetensors"))
    shard = "model-00001-of-00001.safetensors"
    index = {"metadata": {}, "weight_map": {"x": shard, "y": shard}}
    (lying / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="puts 'y' in .*which lacks it"):
        list(iter_checkpoint_tensors(str(lying)))
    (lying / INDEX_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not a readable safetensors index"):
        list_checkpoint_files(str(lying))
