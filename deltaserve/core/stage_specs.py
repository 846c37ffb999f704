"""What pipeline stages must agree on: their layer layouts, one joint KDA checkpoint spec, one cache plan.

Each stage holds only its own layers' cache, under block, slot and checkpoint-unit ids that are the same
on every stage; so every stage must hold a KDA state (a checkpoint must exist on each), all stages must
use the same units per checkpoint, and the plan is the minimum over stages. Pure Python, no tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from deltaserve.config.model_config import FULL_ATTENTION, LINEAR_ATTENTION, KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.core.cache_sizing import CachePlan, default_unit_bytes, plan_cache
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage's decoder layers [start, end) and how many of them are MLA and KDA."""

    pp_rank: int
    start: int
    end: int
    num_mla_layers: int
    num_kda_layers: int


def stage_layouts(config: KimiLinearConfig, pp_size: int) -> list[StageLayout]:
    """Every stage's layout, split as `ParallelConfig.stage_layer_range` splits the model."""
    layouts = []
    for rank in range(pp_size):
        start, end = ParallelConfig(pipeline_parallel_size=pp_size, pipeline_parallel_rank=rank).stage_layer_range(
            config.num_hidden_layers)
        types = config.layer_types[start:end]
        layouts.append(StageLayout(rank, start, end, types.count(FULL_ATTENTION), types.count(LINEAR_ATTENTION)))
    return layouts


def _sizes_with_kda_everywhere(config: KimiLinearConfig) -> list[int]:
    return [n for n in range(1, config.num_hidden_layers + 1)
            if all(s.num_kda_layers for s in stage_layouts(config, n))]


def check_stages_have_kda(config: KimiLinearConfig, pp_size: int) -> list[StageLayout]:
    """The stage layouts, refusing (ValueError) a split where some stage holds no KDA layer; the one
    error names every such stage with its layers and the pipeline_parallel_size values that work."""
    if not 1 <= pp_size <= config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} must be between 1 and num_hidden_layers="
                         f"{config.num_hidden_layers}")
    layouts = stage_layouts(config, pp_size)
    empty = [s for s in layouts if s.num_kda_layers == 0]
    if empty:
        named = ", ".join(f"stage {s.pp_rank} (layers [{s.start}, {s.end}), {s.num_mla_layers} MLA)" for s in empty)
        working = _sizes_with_kda_everywhere(config)
        advice = (f"choose pipeline_parallel_size from {working}" if working
                  else "the model has no KDA layer, so no pipeline split can hold a state checkpoint")
        raise ValueError(
            f"pipeline_parallel_size={pp_size} leaves no KDA layer on {named}; every stage must hold a KDA "
            f"state checkpoint: {advice}"
        )
    return layouts


@dataclass(frozen=True)
class JointCheckpointSpec:
    """The checkpoint layout every stage agrees on: the same `units_per_checkpoint` unit ids everywhere."""

    unit_bytes: int
    units_per_checkpoint: int  # the most any stage needs
    total_image_bytes: int  # summed over stages
    max_stage_image_bytes: int
    layout_id: str  # stable hash of the per-stage images and dtypes


def _image_bytes(stage: KDAStateSpec | int) -> int:
    return stage.bytes_per_image if isinstance(stage, KDAStateSpec) else int(stage)


def _layout_key(stage: KDAStateSpec | int) -> str:
    if isinstance(stage, KDAStateSpec):
        return (f"kda:{stage.num_layers}x{stage.num_heads}x{stage.head_k_dim}x{stage.head_v_dim}"
                f":conv{stage.conv_dim}x{stage.conv_window}:dt{stage.conv_dtype_bytes}/{stage.state_dtype_bytes}")
    return f"bytes:{int(stage)}"


def joint_checkpoint_spec(stages: list[KDAStateSpec | int], unit_bytes: int) -> JointCheckpointSpec:
    """The joint spec from each stage's KDA state (a spec, or its image bytes: recurrent plus conv state
    over its KDA layers), in pp_rank order, and the checkpoint unit size in bytes."""
    if unit_bytes < 1:
        raise ValueError(f"checkpoint_unit_bytes={unit_bytes} must be >= 1")
    if not stages:
        raise ValueError("joint_checkpoint_spec needs at least one stage")
    images = [_image_bytes(s) for s in stages]
    layout = "|".join(f"{rank}={_layout_key(s)}" for rank, s in enumerate(stages)) + f"|unit={unit_bytes}"
    return JointCheckpointSpec(
        unit_bytes=unit_bytes,
        units_per_checkpoint=max(-(-b // unit_bytes) for b in images),
        total_image_bytes=sum(images),
        max_stage_image_bytes=max(images),
        layout_id=hashlib.sha256(layout.encode()).hexdigest()[:16],
    )


def check_agreement(local: JointCheckpointSpec, reported: dict[int, JointCheckpointSpec]) -> None:
    """Refuse (ValueError) when a stage (key: pp_rank) reports a joint spec other than this one's."""
    differing = {rank: spec for rank, spec in sorted(reported.items()) if spec != local}
    if differing:
        named = "; ".join(f"stage {rank} reports {spec}" for rank, spec in differing.items())
        raise ValueError(
            f"pipeline stages disagree on the KDA checkpoint layout: this stage has {local}, but {named}; "
            "every stage must run the same model config, dtype and checkpoint_unit_bytes"
        )


def plan_over_stages(plans: list[CachePlan]) -> CachePlan:
    """The plan every stage can hold: the fewest blocks, state slots and checkpoint units of any stage.

    Stages differ in bytes per block and per slot (their layer counts differ), so each byte total is
    the largest any stage holds at the joint counts, each stage's own per-block and per-slot size
    (`bytes // count` of its plan) times the joint count: the stage that bounds memory. All plans must
    use the same checkpoint unit size (the units are shared ids).
    """
    if not plans:
        raise ValueError("plan_over_stages needs at least one stage's plan")
    unit_sizes = {p.checkpoint_unit_bytes for p in plans if p.num_checkpoint_units}
    if len(unit_sizes) > 1:
        raise ValueError(f"pipeline stages planned different checkpoint unit sizes {sorted(unit_sizes)}; "
                         "plan every stage with the same checkpoint_unit_bytes")
    blocks = min(p.num_blocks for p in plans)
    slots = min(p.num_state_slots for p in plans)
    units = min(p.num_checkpoint_units for p in plans)
    kv = max((p.kv_bytes // p.num_blocks * blocks if p.num_blocks else 0) for p in plans)
    state = max((p.state_bytes // p.num_state_slots * slots if p.num_state_slots else 0) for p in plans)
    unit_bytes = max(p.checkpoint_unit_bytes for p in plans)
    return replace(plans[0], num_blocks=blocks, num_state_slots=slots, num_checkpoint_units=units,
                   kv_bytes=kv, state_bytes=state, checkpoint_unit_bytes=unit_bytes if units else 0)


def model_wide_specs(stages: list[tuple[MLALatentSpec, KDAStateSpec]]) -> tuple[MLALatentSpec, KDAStateSpec]:
    """One TP rank's specs summed over the stages (every layer of the model): what the scheduler's
    KV manager and the checkpoint interval are sized by. Stages agree on every per-layer shape."""
    kv_specs, state_specs = [kv for kv, _ in stages], [st for _, st in stages]
    kv = replace(kv_specs[0], num_layers=sum(k.num_layers for k in kv_specs))
    with_kda = [st for st in state_specs if st.num_layers] or state_specs
    state = replace(with_kda[0], num_layers=sum(st.num_layers for st in state_specs))
    return kv, state


def plan_stage_caches(
    budgets: list[int],
    stages: list[tuple[MLALatentSpec, KDAStateSpec]],
    max_num_seqs: int,
    max_model_len: int,
    slots_per_seq: int = 1,
    checkpoint_fraction: float = 0.0,
    checkpoint_unit_bytes: int | None = None,
) -> tuple[CachePlan, JointCheckpointSpec | None]:
    """Plan each stage's cache from its budget (the smallest over its TP ranks) and specs, in pp_rank
    order, all with one checkpoint unit size; returns the plan every stage holds and, with
    checkpoints, the joint checkpoint spec. At one stage this is `plan_cache`."""
    if len(budgets) != len(stages) or not stages:
        raise ValueError(f"plan_stage_caches: {len(budgets)} budgets for {len(stages)} stages")
    images = [st.bytes_per_image for _, st in stages]
    unit = checkpoint_unit_bytes
    if checkpoint_fraction > 0 and max(images) > 0:
        unit = checkpoint_unit_bytes or default_unit_bytes(max(images))
    plans = []
    for pp_rank, (budget, (kv, st)) in enumerate(zip(budgets, stages, strict=True)):
        try:
            plans.append(plan_cache(budget, kv, st, max_num_seqs, max_model_len, slots_per_seq=slots_per_seq,
                                    checkpoint_fraction=checkpoint_fraction, checkpoint_unit_bytes=unit))
        except ValueError as e:
            if len(stages) == 1:
                raise
            raise ValueError(f"pipeline stage {pp_rank}: {e}") from e
    plan = plan_over_stages(plans)
    joint = None
    if plan.num_checkpoint_units and plan.checkpoint_unit_bytes:
        joint = joint_checkpoint_spec([st for _, st in stages], plan.checkpoint_unit_bytes)
    return plan, joint
