"""The pure helpers of benchmarks/h200_bench.py, model_costs.py and bench_weights.py on CPU: FLOP and
byte formulas against hand counts on the tiny preset, the weight stream against make-model's, and the
hub -> transformers name map."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from deltaserve.core.kv_cache_spec import KDAStateSpec
from deltaserve.model_files.hub_layout import hub_tensor_shapes
from deltaserve.model_files.presets import count_parameters, preset_config
from deltaserve.model_files.random_weights import iter_random_weights

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "h200_bench.py")


def _load():
    spec = importlib.util.spec_from_file_location("h200_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["h200_bench"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


hb = _load()
mc = sys.modules["model_costs"]  # its sibling, imported by it: the FLOP and byte formulas
bw = sys.modules["bench_weights"]  # the other sibling: the seeded weights and their copy into transformers
TINY = preset_config("tiny")  # d 64, KDA 4 x 16 at layers 0, 1, 3, MLA (4 heads) at 2, dense 0, MoE 8 experts top-2
BIG = preset_config("kimi-linear-48b-a3b")


def test_linear_flops_match_a_hand_count():
    # MACs per token: KDA 3*64*64 + 2*(64*16 + 16*64) + 64*4 + 64*64 + 3*64*4 = 21504 per layer, 3 layers;
    # MLA 64*4*24 + 64*40 + 32*4*32 + 4*16*64 = 16896; dense 3*64*128; per MoE layer router 64*8,
    # routed 2*3*64*32, shared 3*64*32, 3 layers
    assert mc.linear_flops_per_token(TINY) == {
        "kda": 2 * 3 * 21504, "mla": 2 * 16896, "dense_mlp": 2 * 24576,
        "router": 2 * 3 * 512, "routed_experts": 2 * 3 * 12288, "shared_experts": 2 * 3 * 6144,
    }
    assert mc.lm_head_flops(TINY) == 2 * 64 * 512


@pytest.mark.parametrize("config", [TINY, BIG], ids=["tiny", "48b"])
def test_linear_flops_cover_the_active_parameters(config):
    # every active parameter is one multiply-add per token, except the vectors (norms, gates' biases)
    vectors = sum(math.prod(shape) for name, (shape, _) in hub_tensor_shapes(config).items()
                  if len(shape) != 2 and "conv1d" not in name)
    macs = sum(mc.linear_flops_per_token(config).values()) // 2 + mc.lm_head_flops(config) // 2
    assert macs + vectors == count_parameters(config).active


def test_mla_attention_is_the_causal_count():
    per_key = 2 * 4 * (24 + 16)  # 2 * heads * (qk_dim + v_dim), one MLA layer
    assert mc.mla_attention_flops(TINY, 10) == per_key * 55  # 1 + 2 + ... + 10 keys
    assert mc.mla_attention_flops(TINY, 3, num_context_tokens=5) == per_key * (6 + 7 + 8)
    # chunking a prompt does not change its model FLOPs
    assert mc.mla_attention_flops(TINY, 7) + mc.mla_attention_flops(TINY, 5, 7) == mc.mla_attention_flops(TINY, 12)
    # the 48B shape at 32k: about L * H * (qk + v) per token per layer
    per_token = mc.mla_attention_flops(BIG, 32768) / 32768
    assert per_token == pytest.approx(32768 * 32 * 320 * 7, rel=1e-3)


def test_kda_chunk_flops():
    macs = 64 * 2.5 * 16 + 64 * 64 / 6 + 3 * 16 * 16  # per token per head at C=64, K=V=16
    assert mc.kda_chunk_flops(TINY, 100) == pytest.approx(2 * macs * 4 * 3 * 100)
    per_head = mc.kda_chunk_flops(BIG, 1) / (32 * 20)
    assert 0.1e6 < per_head < 0.2e6  # the documented ~0.14 MFLOP per token per head


def test_prefill_flops_add_up():
    f = mc.prefill_flops(TINY, [10, 20])
    expected = (30 * sum(mc.linear_flops_per_token(TINY).values()) + 2 * mc.lm_head_flops(TINY)
                + mc.mla_attention_flops(TINY, 10) + mc.mla_attention_flops(TINY, 20) + mc.kda_chunk_flops(TINY, 30))
    assert f["total"] == pytest.approx(expected)
    assert f["per_token"] == pytest.approx(expected / 30)
    assert f["lm_head"] == 2 * mc.lm_head_flops(TINY)


def test_expected_distinct_experts():
    assert mc.expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert mc.expected_distinct_experts(256, 8, 0) == 0
    assert mc.expected_distinct_experts(256, 8, 64) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 64))
    assert mc.expected_distinct_experts(256, 8, 4096) == pytest.approx(256, rel=1e-6)
    values = [mc.expected_distinct_experts(256, 8, b) for b in (1, 16, 64, 256)]
    assert values == sorted(values)


def test_kda_state_bytes_match_the_engine_spec():
    assert mc.kda_state_bytes_per_request(BIG) == 43417600  # 20 x (32*128*128*4 + 3*4096*3*2)
    spec = KDAStateSpec(num_layers=3, num_heads=4, head_k_dim=16, head_v_dim=16, conv_dim=3 * 64, conv_window=3,
                        conv_dtype_bytes=2)
    assert mc.kda_state_bytes_per_request(TINY) == spec.bytes_per_image


def test_weight_bytes_partition_the_checkpoint():
    w = mc.weight_bytes(BIG)
    fp32 = sum(math.prod(s) for s, kind in hub_tensor_shapes(BIG).values() if kind == "float32")
    assert w["routed_experts"] + w["embedding"] + w["lm_head"] + w["rest"] == 2 * count_parameters(BIG).total + 2 * fp32
    assert w["routed_experts"] == 26 * 256 * w["per_expert"]
    assert w["per_expert"] == 3 * 2304 * 1024 * 2
    assert w["lm_head"] == w["embedding"] == 163840 * 2304 * 2


def test_decode_step_bytes_by_hand():
    b = mc.decode_step_bytes(TINY, batch=2, total_context=100, distinct_experts=3)
    assert b["latents_read"] == 100 * 40 * 2  # one MLA layer, 32 + 8 values of 2 bytes
    assert b["latents_written"] == 2 * 40 * 2
    assert b["kda_state"] == 2 * 2 * 3 * (4 * 16 * 16 * 4 + 3 * 64 * 3 * 2)
    assert b["routed_experts"] == 3 * 3 * (3 * 64 * 32 * 2)
    assert b["embedding"] == 2 * 64 * 2 and b["lm_head"] == 512 * 64 * 2
    assert b["weights_rest"] == mc.weight_bytes(TINY)["rest"]
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"))


def test_device_weights_on_cpu_equal_make_models():
    ours = dict(bw.seeded_weights(TINY, 3, torch.float32, "cpu", "device"))
    theirs = dict(iter_random_weights(TINY, 3, torch.float32, "cpu"))
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    with pytest.raises(ValueError, match="weights='disk'"):
        next(bw.seeded_weights(TINY, 0, torch.float32, "cpu", "disk"))


def test_fingerprints_follow_the_values():
    one, two = {}, {}
    list(bw.fingerprinted(bw.seeded_weights(TINY, 1, torch.float32, "cpu"), TINY, one))
    list(bw.fingerprinted(bw.seeded_weights(TINY, 1, torch.float32, "cpu"), TINY, two))
    assert one == two and len(one) == 4
    other = {}
    list(bw.fingerprinted(bw.seeded_weights(TINY, 2, torch.float32, "cpu"), TINY, other))
    assert all(one[k] != other[k] for k in one)


def test_hf_target_names():
    t = bw.hf_target
    assert t("model.embed_tokens.weight", TINY) == ("model.embed_tokens.weight", None, None)
    assert t("model.layers.1.self_attn.k_conv1d.weight", TINY) == ("model.layers.1.self_attn.conv1d.weight", None,
                                                                   slice(64, 128))
    assert t("model.layers.0.self_attn.dt_bias", TINY) == ("model.layers.0.self_attn.forget_gate.dt_bias", None, None)
    kda = "model.layers.0.self_attn"
    assert t(f"{kda}.f_b_proj.weight", TINY)[0] == f"{kda}.forget_gate.f_b_proj.weight"
    assert t("model.layers.0.self_attn.g_b_proj.weight", TINY)[0] == "model.layers.0.self_attn.g_b_proj.weight"
    assert t("model.layers.2.self_attn.kv_b_proj.weight", TINY)[0] == "model.layers.2.self_attn.kv_b_proj.weight"
    assert t("model.layers.0.mlp.up_proj.weight", TINY)[0] == "model.layers.0.mlp.up_proj.weight"
    moe = "model.layers.3.block_sparse_moe"
    assert t(f"{moe}.experts.5.w1.weight", TINY) == ("model.layers.3.mlp.experts.gate_up_proj", 5, slice(0, 32))
    assert t(f"{moe}.experts.5.w3.weight", TINY) == ("model.layers.3.mlp.experts.gate_up_proj", 5, slice(32, 64))
    assert t(f"{moe}.experts.7.w2.weight", TINY) == ("model.layers.3.mlp.experts.down_proj", 7, None)
    assert t(f"{moe}.gate.e_score_correction_bias", TINY)[0] == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert t(f"{moe}.shared_experts.down_proj.weight", TINY)[0] == "model.layers.3.mlp.shared_experts.down_proj.weight"


def test_table_and_comparison_render_partial_results():
    results = {
        "ceilings": {"copy_bytes": 2**32, "copy_GBps": 4000.0, "matmul_shape": [8192] * 3, "matmul_TFLOPs": 700.0},
        "prefill": {"1x32768": {"tokens_per_s": 3e4, "seconds": 1.1, "mfu": 0.41}, "seconds": 3.0},
        "decode": {"batch_1": {"batch": 1, "mean_context": 4100, "step_s": 0.004, "step_s_median": 0.004,
                               "tokens_per_s": 250, "mbu": 0.5, "schedule_s": 1e-4},
                   "batch_1_async": {"batch": 1, "async_scheduling": True, "mean_context": 4100, "step_s": 0.003,
                                     "step_s_median": 0.003, "tokens_per_s": 333, "mbu": 0.6, "schedule_s": 1e-4,
                                     "profile": {"kernel_us_per_step": 2900.0}}},
        "offline": {"error": "OutOfMemoryError: CUDA out of memory"},
        "compare_deltaserve": {"decode_s_per_token": 0.005, "prefill_s": 0.5, "prefill_tokens": 8192,
                               "greedy_tokens": [1, 2, 3]},
        "transformers": {"decode_s_per_token": 0.05, "prefill_s": 1.0, "greedy_tokens": [1, 2, 4]},
        "weights": {"deltaserve_fingerprints": {"a": 1}, "transformers_fingerprints": {"a": 1}},
    }
    results["comparison"] = hb.comparison(results)
    assert results["comparison"]["decode_speedup"] == pytest.approx(10)
    assert results["comparison"]["greedy_prefix_match"] == 2 and results["comparison"]["weights_identical"]
    text = hb.table(results)
    for fragment in ("MFU 41.0%", "MBU 50.0%", ">= 60% MBU", "10.0x", "FAILED", "OutOfMemoryError", "async on",
                     "median 3.00 ms/step", "kernels 2.90 ms"):
        assert fragment in text


def test_timed_steps_takes_the_median_of_steps_that_ran_the_model():
    """A step that launched nothing (async scheduling with nothing to collect) counts in the mean step, as
    before, but not in the median and minimum, which are over the steps that called execute_model."""
    import time
    from types import SimpleNamespace

    class Engine:
        def __init__(self):
            self.core = SimpleNamespace(scheduler=SimpleNamespace(schedule=lambda: None),
                                        executor=SimpleNamespace(execute_model=lambda: time.sleep(0.004)))
            self.count = 0

        def step(self):
            self.count += 1
            self.core.scheduler.schedule()
            if self.count % 2:  # every other step runs the model
                self.core.executor.execute_model()

    engine = Engine()
    timing = hb.timed_steps(engine, 6)
    assert timing["steps_with_model"] == 3 and timing["steps_without_model"] == 3
    assert timing["step_s_median"] >= 0.004 and timing["step_s_min"] >= 0.004
    assert timing["step_s"] < timing["step_s_median"]  # the mean is diluted by the empty steps


def test_routing_probe_counts_routed_experts_beside_a_fused_shared_one():
    """With the shared expert fused in as expert E, the MoE passes ids up to E: the probe counts the
    distinct routed experts (E excluded) and indexes nothing out of range."""
    import deltaserve.model.layers.moe as moe_layer

    experts, hidden, inter = 4, 16, 8
    w13, w2 = torch.randn(experts + 1, 2 * inter, hidden), torch.randn(experts + 1, hidden, inter)
    ids = torch.tensor([[0, 2, experts], [2, 3, experts]])
    weights = torch.ones(2, 3)
    engine = SimpleNamespace(core=SimpleNamespace(executor=None))  # no runner: no graphs to set aside
    with hb.routing_probe(engine, experts) as calls:
        moe_layer.fused_moe(torch.randn(2, hidden), w13, w2, weights, ids, None)
    assert [(tokens, int(hit)) for tokens, hit in calls] == [(2, 3)]
