"""Stage layouts, the KDA-on-every-stage check, the joint checkpoint spec and the plan over stages."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltaserve.config.model_config import FULL_ATTENTION as MLA
from deltaserve.config.model_config import LINEAR_ATTENTION as KDA
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan, plan_cache
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.stage_specs import (
    JointCheckpointSpec,
    StageLayout,
    check_agreement,
    check_stages_have_kda,
    joint_checkpoint_spec,
    model_wide_specs,
    plan_over_stages,
    plan_stage_caches,
    stage_layouts,
)
from deltaserve.model_files.presets import preset_config


def _with_layers(*types: str) -> KimiLinearConfig:
    tiny = preset_config("tiny")
    return replace(tiny, num_hidden_layers=len(types), layer_types=types,
                   mlp_layer_types=tiny.mlp_layer_types[:1] * len(types))


def test_tiny_pp2_layouts() -> None:
    assert check_stages_have_kda(preset_config("tiny"), 2) == [
        StageLayout(0, 0, 2, num_mla_layers=0, num_kda_layers=2),
        StageLayout(1, 2, 4, num_mla_layers=1, num_kda_layers=1),
    ]


def test_tiny_pp4_refused_naming_stage_and_suggesting() -> None:
    with pytest.raises(ValueError) as err:
        check_stages_have_kda(preset_config("tiny"), 4)
    msg = str(err.value)
    assert "pipeline_parallel_size=4 leaves no KDA layer on stage 2 (layers [2, 3), 1 MLA)" in msg
    assert "choose pipeline_parallel_size from [1, 2]" in msg


def test_pure_mla_middle_stage_refused() -> None:
    config = _with_layers(KDA, MLA, KDA)
    assert [s.num_kda_layers for s in check_stages_have_kda(config, 2)] == [1, 1]
    with pytest.raises(ValueError, match=r"stage 1 \(layers \[1, 2\), 1 MLA\).*from \[1, 2\]"):
        check_stages_have_kda(config, 3)


def test_every_empty_stage_named_in_one_error() -> None:
    config = _with_layers(MLA, KDA, KDA, MLA)
    with pytest.raises(ValueError) as err:
        check_stages_have_kda(config, 4)
    msg = str(err.value)
    assert "stage 0 (layers [0, 1), 1 MLA)" in msg and "stage 3 (layers [3, 4), 1 MLA)" in msg
    assert "from [1, 2]" in msg


def test_no_kda_model_and_bad_size() -> None:
    with pytest.raises(ValueError, match="no KDA layer, so no pipeline split"):
        check_stages_have_kda(_with_layers(MLA, MLA), 1)
    with pytest.raises(ValueError, match="between 1 and num_hidden_layers=4"):
        check_stages_have_kda(preset_config("tiny"), 5)


def _kda(num_layers: int) -> KDAStateSpec:
    # per layer: conv 192 x 3 x 4 = 2304 bytes, recurrent 4 x 16 x 16 x 4 = 4096 bytes
    return KDAStateSpec(num_layers=num_layers, num_heads=4, head_k_dim=16, head_v_dim=16,
                        conv_dim=192, conv_window=3, conv_dtype_bytes=4)


def test_joint_spec_numbers() -> None:
    layouts = stage_layouts(preset_config("tiny"), 2)
    spec = joint_checkpoint_spec([_kda(s.num_kda_layers) for s in layouts], unit_bytes=4096)
    assert spec.total_image_bytes == 3 * 6400
    assert spec.max_stage_image_bytes == 2 * 6400
    assert spec.units_per_checkpoint == 4  # ceil(12800 / 4096); stage 1 alone needs 2
    assert spec.unit_bytes == 4096
    same = joint_checkpoint_spec([_kda(2), _kda(1)], unit_bytes=4096)
    assert same.layout_id == spec.layout_id
    # plain byte counts work too, and a different layout or dtype hashes differently
    raw = joint_checkpoint_spec([12800, 6400], unit_bytes=4096)
    assert raw.units_per_checkpoint == 4 and raw.layout_id != spec.layout_id
    other_dtype = joint_checkpoint_spec([_kda(2), replace(_kda(1), conv_dtype_bytes=2)], unit_bytes=4096)
    assert other_dtype.layout_id != spec.layout_id


def test_agreement() -> None:
    local = joint_checkpoint_spec([_kda(2), _kda(1)], unit_bytes=4096)
    check_agreement(local, {0: local, 1: local})
    bad = joint_checkpoint_spec([_kda(2), _kda(1)], unit_bytes=2048)
    with pytest.raises(ValueError, match="stage 1 reports") as err:
        check_agreement(local, {0: local, 1: bad})
    assert "stage 0 reports" not in str(err.value)
    assert isinstance(bad, JointCheckpointSpec)


def test_plan_over_stages_takes_minimum() -> None:
    a = CachePlan(num_blocks=100, num_state_slots=8, kv_bytes=100 * 64, state_bytes=8 * 10,
                  num_checkpoint_units=20, checkpoint_unit_bytes=4096)
    b = CachePlan(num_blocks=80, num_state_slots=10, kv_bytes=80 * 64, state_bytes=10 * 10,
                  num_checkpoint_units=30, checkpoint_unit_bytes=4096)
    c = CachePlan(num_blocks=90, num_state_slots=9, kv_bytes=90 * 64, state_bytes=9 * 10,
                  num_checkpoint_units=12, checkpoint_unit_bytes=4096)
    plan = plan_over_stages([a, b, c])
    assert (plan.num_blocks, plan.num_state_slots, plan.num_checkpoint_units) == (80, 8, 12)
    assert (plan.kv_bytes, plan.state_bytes, plan.checkpoint_unit_bytes) == (80 * 64, 8 * 10, 4096)
    with pytest.raises(ValueError, match="at least one"):
        plan_over_stages([])


def test_plan_over_stages_bytes_are_the_largest_stage_at_the_joint_counts() -> None:
    # stage 0: 64-byte blocks, 10-byte slots; stage 1: 32-byte blocks, 30-byte slots (uneven layers)
    a = CachePlan(num_blocks=100, num_state_slots=8, kv_bytes=100 * 64, state_bytes=8 * 10,
                  num_checkpoint_units=20, checkpoint_unit_bytes=4096)
    b = CachePlan(num_blocks=80, num_state_slots=10, kv_bytes=80 * 32, state_bytes=10 * 30,
                  num_checkpoint_units=30, checkpoint_unit_bytes=4096)
    plan = plan_over_stages([a, b])
    assert (plan.num_blocks, plan.num_state_slots, plan.num_checkpoint_units) == (80, 8, 20)
    assert (plan.kv_bytes, plan.state_bytes) == (80 * 64, 8 * 30)  # not the first stage's sizes alone
    with pytest.raises(ValueError, match="different checkpoint unit sizes"):
        plan_over_stages([a, replace(b, checkpoint_unit_bytes=2048)])


def _mla(num_layers: int) -> MLALatentSpec:
    return MLALatentSpec(block_size=16, num_layers=num_layers, latent_dim=40, dtype_bytes=4)


def test_plan_stage_caches_one_unit_size_and_joint_spec() -> None:
    stages = [(_mla(0), _kda(2)), (_mla(1), _kda(1))]
    budget = 8 << 20
    plan, joint = plan_stage_caches([budget, budget], stages, max_num_seqs=4, max_model_len=256,
                                    slots_per_seq=2, checkpoint_fraction=0.25)
    assert joint is not None and joint.units_per_checkpoint == 1 and joint.unit_bytes == 12800
    assert plan.checkpoint_unit_bytes == 12800  # the largest stage's image decides the unit for both
    singles = [plan_cache(budget, kv, st, 4, 256, slots_per_seq=2, checkpoint_fraction=0.25,
                          checkpoint_unit_bytes=12800) for kv, st in stages]
    assert plan.num_blocks == min(p.num_blocks for p in singles)
    assert plan.num_checkpoint_units == min(p.num_checkpoint_units for p in singles)
    # at one stage it is plan_cache itself, and no checkpoints means no joint spec
    one, none = plan_stage_caches([budget], stages[:1], 4, 256, slots_per_seq=1)
    assert one == plan_cache(budget, *stages[0], 4, 256) and none is None
    with pytest.raises(ValueError, match=r"pipeline stage 1: the cache budget"):
        plan_stage_caches([budget, 1000], stages, 4, 256)


def test_model_wide_specs_sum_the_stages() -> None:
    kv, state = model_wide_specs([(_mla(0), _kda(2)), (_mla(1), _kda(1))])
    assert (kv.num_layers, state.num_layers) == (1, 3) and state.bytes_per_image == 3 * 6400
