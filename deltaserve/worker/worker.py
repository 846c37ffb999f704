"""One rank's worker: its device, its stage of the model, its slice of the caches, its model runner."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.kv_transfer.staging import staging_reserve_bytes
from deltaserve.kv_transfer.worker_side import KVConnectorWorker
from deltaserve.model.eagle3 import Eagle3Head
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.model.layers import mla
from deltaserve.model.loader import load_model_from_dir, resolve_dtype
from deltaserve.model_files.random_model import build_random_model, random_preset_name
from deltaserve.offload.worker_side import OffloadWorker
from deltaserve.ops.moe.grouped import grouped_mm_supported
from deltaserve.worker.cuda_graph import DecodeGraphs, capture_sizes
from deltaserve.worker.model_runner import ModelRunner
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from deltaserve.worker.state_store import StateCheckpointStore
from deltaserve.worker.verify_graph import VerifyGraphs, graph_memory_bytes, verify_capture_sizes

logger = logging.getLogger(__name__)
# an Eagle3 head's keys and values per token, in memory at once at most: its per-request caches (grown by
# a quarter when full) and each step's padded copy of them (at most 1.5 times, spec/eagle3_drafter.py)
EAGLE3_CACHE_COPIES = 2.75

DEFAULT_CPU_CACHE_BYTES = 256 << 20


def load_draft_model(model: str, target: KimiLinearConfig, dtype: torch.dtype, device: torch.device,
                     seed: int) -> KimiLinearForCausalLM:
    """Speculative decoding's draft model (a Kimi Linear checkpoint directory or random:<preset>), as one
    rank; refused when its vocabulary is not the target's."""
    from deltaserve.model_files.random_model import random_model_config

    one_rank = ParallelConfig()
    if random_preset_name(model) is not None:
        config = random_model_config(model)
    else:
        config = KimiLinearConfig.from_pretrained(model)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {model!r} has vocab_size={config.vocab_size}, the "
                         f"target {target.vocab_size}; a draft model must share the target's vocabulary")
    if random_preset_name(model) is not None:
        return build_random_model(config, one_rank, dtype, device, seed + 1)
    return load_model_from_dir(model, config, one_rank, dtype, device)


def resolve_device(device: str | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    return dev


class Worker:
    """Loads the model, sizes and allocates the caches, executes steps."""

    def __init__(self, engine_config: EngineConfig, model_config: KimiLinearConfig, model_dir: str,
                 parallel: ParallelConfig | None = None, device: torch.device | None = None) -> None:
        """`parallel`: this rank's place in the TP x PP grid (a rank process of the multi-process
        executor, after deltaserve.distributed.init_distributed); None: the engine's, one rank.
        `device`: this rank's device (the executor's placement); None: from engine_config.device."""
        self.engine_config = engine_config
        self.model_config = model_config
        self.model_dir = model_dir
        self.parallel = engine_config.parallel if parallel is None else parallel
        self.device = resolve_device(engine_config.device) if device is None else device
        self.dtype = resolve_dtype(engine_config.dtype, model_config)
        self.model: KimiLinearForCausalLM | None = None
        self.runner: ModelRunner | None = None
        self.kv_connector: KVConnectorWorker | None = None  # P/D: built once the caches exist
        self.offload: OffloadWorker | None = None  # the offload tier's rank side: built once the caches exist
        dcp = self.parallel.decode_context_parallel_size
        # decode context parallelism: this rank stores its stripe of every sequence's MLA latents
        self.dcp = (DCPLayout(dcp, self.parallel.decode_context_parallel_rank, engine_config.block_size,
                              engine_config.dcp_kv_cache_interleave_size) if dcp > 1 else None)
        torch.manual_seed(engine_config.seed)

    # Setup -----------------------------------------------------------------------------------
    def load_model(self, model: KimiLinearForCausalLM | None = None) -> None:
        """Load from the checkpoint directory, or adopt an already built model (random weights in memory)."""
        if model is None and random_preset_name(self.model_dir) is not None:
            model = build_random_model(self.model_config, self.parallel, self.dtype, self.device,
                                       self.engine_config.seed)
        elif model is None:
            model = load_model_from_dir(self.model_dir, self.model_config, self.parallel, self.dtype, self.device)
        self.model = model
        self.runner = ModelRunner(model, self.scheduler_block_size, self.device, self.dcp)
        self._load_drafter()

    def _load_drafter(self) -> None:
        """Speculative decoding's model drafter, loaded before the caches are sized (its weights count):
        an Eagle3 head on every rank (each stage captures the taps it owns; the output rank drafts), a
        draft model on the output rank only (the last stage's first TP rank, which samples)."""
        self.draft_weights: Any = None
        spec = self.engine_config.speculative_config
        if self.engine_config.num_speculative_tokens == 0 or spec.method == "ngram":
            return
        output_rank = self.parallel.is_last_stage and self.parallel.tensor_parallel_rank == 0
        if spec.method == "eagle3":
            from deltaserve.spec.eagle3_drafter import eagle3_tap_layers, load_eagle3_head

            self.model.tap_layer_ids = eagle3_tap_layers(spec.model, self.model_config)
            if output_rank:
                self.draft_weights = load_eagle3_head(spec.model, self.model_config, self.dtype, self.device)
        elif output_rank:
            self.draft_weights = load_draft_model(spec.model, self.model_config, self.dtype, self.device,
                                                  self.engine_config.seed)

    def _draft_cache_share(self) -> float:
        """A model drafter's caches as a share of the target's on this rank. A draft model: its latents per
        token, or twice its state image per slot (its live rows, and scratch rows for drafting), against the
        target's. An Eagle3 head: its keys and values per token, EAGLE3_CACHE_COPIES times (see there),
        against the target's latents per token (no request's head cache outgrows its own blocks)."""
        draft, target = self.draft_weights, self.model
        latent_bytes = self.model_config.latent_dim * self.dtype.itemsize
        target_kv = len(target.mla_layers()) * latent_bytes
        if isinstance(draft, Eagle3Head):
            head = draft.config
            head_kv = 2 * head.num_attention_heads * head.head_dim * draft.fc.weight.element_size()
            return EAGLE3_CACHE_COPIES * head_kv / target_kv if target_kv else 0.0
        if not isinstance(draft, KimiLinearForCausalLM):
            return 0.0
        draft_kv = len(draft.mla_layers()) * draft.config.latent_dim * self.dtype.itemsize

        def image(model: KimiLinearForCausalLM) -> int:
            return sum(layer.num_heads * layer.head_dim**2 * 4 + 3 * layer.local_dim * (layer.conv_width - 1)
                       * self.dtype.itemsize for layer in model.kda_layers())

        shares = [draft_kv / target_kv if target_kv else 0.0, 2 * image(draft) / max(image(target), 1)]
        return max(shares)

    @property
    def scheduler_block_size(self) -> int:
        """Tokens one scheduler block covers: block_size, times the DCP group's size under DCP (each
        rank's page holds block_size of them)."""
        return self.dcp.scheduler_block_size if self.dcp is not None else self.engine_config.block_size

    def cache_specs(self) -> tuple[MLALatentSpec, KDAStateSpec]:
        assert self.model is not None
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        kda = self.model.kda_layers()
        first = kda[0] if kda else None
        kv_spec = MLALatentSpec(
            block_size=self.scheduler_block_size,
            dcp_size=self.dcp.size if self.dcp is not None else 1,
            num_layers=len(self.model.mla_layers()),
            latent_dim=self.model_config.latent_dim,
            dtype_bytes=dtype_bytes,
        )
        state_spec = KDAStateSpec(
            num_layers=len(kda),
            num_heads=first.num_heads if first else 0,
            head_k_dim=first.head_dim if first else 0,
            head_v_dim=first.head_dim if first else 0,
            conv_dim=3 * first.local_dim if first else 0,
            conv_window=self.model_config.short_conv_kernel_size - 1,
            conv_dtype_bytes=dtype_bytes,
        )
        return kv_spec, state_spec

    def available_cache_bytes(self) -> int:
        """Bytes the caches may take: --cache-memory if given, else a share of free GPU memory; less a
        P/D producer's MLA staging reserve, and a draft model's caches."""
        budget = self._cache_budget_bytes() - self.staging_reserve_bytes()
        return int(budget / (1.0 + self._draft_cache_share()))  # the rest for a draft model's own caches

    def staging_reserve_bytes(self) -> int:
        """A P/D producer's MLA staging slots on this rank (kv_transfer/staging.py); 0 without staging."""
        transfer = self.engine_config.kv_transfer_config
        if transfer is None or not transfer.is_producer or not transfer.staging_chunk_pages:
            return 0
        assert self.model is not None
        return staging_reserve_bytes(transfer.staging_chunk_pages, transfer.staging_slots,
                                     self.engine_config.block_size, self.model_config.latent_dim,
                                     self.dtype.itemsize,
                                     len(list(self.model.mla_layers())))

    def _cache_budget_bytes(self) -> int:
        if self.engine_config.cache_memory is not None:
            return int(self.engine_config.cache_memory)
        if self.device.type != "cuda":
            return DEFAULT_CPU_CACHE_BYTES
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.engine_config.gpu_memory_utilization - used_by_others
        # leave room for activations of the largest step, and for the CUDA graphs captured after the plan
        return int(budget - torch.cuda.memory_allocated(self.device) - self.activation_reserve_bytes()
                   - self.graph_memory_bytes())

    def activation_reserve_bytes(self) -> int:
        """What the cache budget leaves for a step's activations: a rough allowance per token of the
        largest step, plus MLA prefill's expanded K/V, which hold up to EXPANSION_GROUP_TOKENS of cached
        context and the step's new tokens at once (layers/mla.py), per layer in turn."""
        tokens = self.engine_config.max_num_batched_tokens
        return tokens * self._activation_bytes_per_token() + self._mla_expansion_bytes(tokens)

    def _activation_bytes_per_token(self) -> int:
        """A rough allowance for one token's activations in a forward step."""
        cfg = self.model_config
        return 4 * (cfg.hidden_size * 8 + cfg.vocab_size // 64 + cfg.intermediate_size * 2)

    def _mla_expansion_bytes(self, step_tokens: int) -> int:
        """MLA prefill's largest expansion on this rank: the latents gathered, kv_b_proj's K_nope|V, K with
        k_pe, and V padded to the q/k head size, for EXPANSION_GROUP_TOKENS + step_tokens tokens; 0
        without MLA layers."""
        cfg = self.model_config
        if not cfg.mla_layer_ids:
            return 0
        heads = cfg.num_attention_heads // self.parallel.tensor_parallel_size
        per_token = cfg.latent_dim + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim + 2 * cfg.qk_head_dim)
        return (mla.EXPANSION_GROUP_TOKENS + step_tokens) * per_token * self.dtype.itemsize

    def _decode_graphs_off(self) -> str | None:
        """Why this rank captures no decode (and verify) graphs, as the log line ends, or None when it does;
        "" where nothing needs saying (a CPU rank, --enforce-eager)."""
        if self.parallel.pipeline_parallel_size > 1:
            return " under pipeline parallelism (not captured per stage yet)"
        if self.dcp is not None:
            return " under decode context parallelism (not captured yet)"
        if self.device.type != "cuda" or self.engine_config.enforce_eager:
            return ""
        assert self.model is not None
        if not _decode_is_capturable(self.model):
            return ": the MoE layers need bfloat16 on sm90+ to be capturable"
        return None

    def graph_memory_bytes(self) -> int:
        """The estimate of what this rank's CUDA graphs take (verify_graph.graph_memory_bytes); 0 without."""
        if self._decode_graphs_off() is not None:
            return 0
        cfg = self.engine_config
        k = cfg.num_speculative_tokens
        return graph_memory_bytes(cfg.max_num_seqs, cfg.max_model_len or self.model_config.max_position_embeddings,
                                  cfg.block_size, self.model_config.vocab_size, self._activation_bytes_per_token(),
                                  window=k + 1 if k else 0)

    def initialize_cache(self, plan: CachePlan) -> None:
        """Allocate the paged latent caches and the KDA state pool, and bind them to the layers.

        One block and one state slot more than the plan are allocated, past the scheduler's ids: the
        scratch rows that CUDA-graph padding writes to.
        """
        assert self.model is not None
        bs = self.engine_config.block_size
        num_blocks, num_slots = plan.num_blocks + 1, plan.num_state_slots + 1
        logger.info("cache: %d KV blocks of %d tokens (%.2f GiB), %d KDA state slots (%.2f GiB), %d checkpoint "
                    "units of %d B (%.2f GiB)", plan.num_blocks, bs, plan.kv_bytes / 2**30, plan.num_state_slots,
                    plan.state_bytes / 2**30, plan.num_checkpoint_units, plan.checkpoint_unit_bytes,
                    plan.checkpoint_bytes / 2**30)
        with torch.device(self.device):
            for layer in self.model.mla_layers():
                layer.bind_cache(torch.zeros(num_blocks, bs, self.model_config.latent_dim, dtype=self.dtype))
            for layer in self.model.kda_layers():
                conv = torch.zeros(num_slots, 3 * layer.local_dim, layer.conv_width - 1, dtype=self.dtype)
                rec = torch.zeros(num_slots, layer.num_heads, layer.head_dim, layer.head_dim, dtype=torch.float32)
                layer.bind_state(conv, rec)
        assert self.runner is not None
        self.runner.dcp_pad_slot = plan.num_blocks * bs  # the scratch block's first slot
        if plan.num_checkpoint_units:
            tensors = [t for layer in self.model.kda_layers() for t in (layer.conv_state, layer.recurrent_state)]
            store = StateCheckpointStore(tensors, plan.num_checkpoint_units, plan.checkpoint_unit_bytes)
            assert self.runner is not None
            self.runner.state_store = store
            for i, layer in enumerate(self.model.kda_layers()):  # checkpoints captured inside prefill chunks
                layer.bind_captures(functools.partial(store.save_part, 2 * i),
                                    functools.partial(store.save_part, 2 * i + 1))
        transfer = self.engine_config.kv_transfer_config
        if transfer is not None:
            self.kv_connector = KVConnectorWorker(transfer, self.parallel, bs,
                                                  self.engine_config.dcp_kv_cache_interleave_size)
            self.kv_connector.register(self.model)
        if self.engine_config.offloading_enabled:
            assert self.runner.state_store is not None, "the offload tier needs prefix caching's checkpoint units"
            max_model_len = self.engine_config.max_model_len or self.model_config.max_position_embeddings
            self.offload = self.runner.offload = OffloadWorker.build(
                self.engine_config, self.model, self.parallel, self.runner.state_store.units, max_model_len)
        self._build_drafter(plan)
        off = self._decode_graphs_off()
        if off is None:
            self._capture_decode_graphs(pad_block=plan.num_blocks, pad_state_slot=plan.num_state_slots)
        elif off:
            logger.info("decode runs without CUDA graphs%s", off)

    def _build_drafter(self, plan: CachePlan) -> None:
        """Speculative decoding's draft model, on the output rank only (the last stage's first TP rank,
        which samples): one model on one rank, its caches beside the target's."""
        spec = self.engine_config.speculative_config
        parallel = self.parallel
        if self.draft_weights is None or not (parallel.is_last_stage and parallel.tensor_parallel_rank == 0):
            return
        cfg = self.engine_config
        max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        assert self.runner is not None
        if spec.method == "eagle3":
            from deltaserve.spec.eagle3_drafter import Eagle3Drafter

            self.runner.drafter = Eagle3Drafter(self.draft_weights, spec.num_speculative_tokens, max_model_len)
            return
        from deltaserve.spec.draft_model import DraftModelRunner

        model = self.draft_weights
        # past the target's ids: the scratch block and slot that CUDA-graph padding writes to
        drafter = self.runner.drafter = DraftModelRunner(
            model, spec.num_speculative_tokens, cfg.block_size, plan.num_blocks + 1, plan.num_state_slots + 1,
            cfg.max_num_seqs, max_model_len, cfg.max_num_batched_tokens, self.device)
        if self.device.type == "cuda" and not cfg.enforce_eager and _decode_is_capturable(model):
            drafter.capture_graphs(capture_sizes(cfg.max_num_seqs))
        logger.info("draft model %s: %d drafts per step, on this rank", spec.model, spec.num_speculative_tokens)

    def _capture_decode_graphs(self, pad_block: int, pad_state_slot: int) -> None:
        assert self.model is not None and self.runner is not None
        cfg = self.engine_config
        max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        graphs = DecodeGraphs(self.model, self.device, cfg.block_size, max_model_len, pad_block, pad_state_slot)
        if not graphs.capture(capture_sizes(cfg.max_num_seqs)):
            return
        self.runner.decode_graphs = graphs
        if cfg.num_speculative_tokens:  # verify windows of k + 1 tokens (decode rows ride along as windows of one)
            window = cfg.num_speculative_tokens + 1
            verify = VerifyGraphs(self.model, self.device, cfg.block_size, max_model_len, pad_block, pad_state_slot,
                                  window=window)
            if verify.capture(verify_capture_sizes(cfg.max_num_seqs, window)):
                self.runner.verify_graphs = verify

    # Steps -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step; with non_block, return once it is queued (see ModelRunner.execute)."""
        assert self.runner is not None, "load_model() first"
        connector = self.kv_connector
        if connector is None and self.offload is None:
            return self.runner.execute(scheduler_output, non_block)
        if connector is not None:
            connector.start_loads(scheduler_output.kv_connector_metadata)
        output = self.runner.execute(scheduler_output, non_block)
        # after the forward: the P/D loads ran beside it; the offload tier's loads ran before it
        reports = {"kv_connector_output": connector.poll() if connector is not None else None,
                   "offload_output": self.offload.poll() if self.offload is not None else None}
        if isinstance(output, ModelRunnerOutput):
            return dataclasses.replace(output, **reports)
        if output.is_ready:  # the CPU's: a handle that waits for nothing stays one
            return AsyncModelRunnerOutput.ready(dataclasses.replace(output.get_output(), **reports))
        return AsyncModelRunnerOutput(lambda: dataclasses.replace(output.get_output(), **reports))

    def kv_layout(self) -> Any:
        """This rank's registered caches (kv_transfer.layout.RankLayout), or None without a KV connector."""
        return None if self.kv_connector is None else self.kv_connector.layout

    def shutdown(self) -> None:
        if self.offload is not None:
            self.offload.close()
            self.offload = None
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None


def _decode_is_capturable(model: KimiLinearForCausalLM) -> bool:
    """Every routed-expert layer must take the sync-free grouped GEMM (bf16 on sm90+); the loop that
    other dtypes fall back to reads ids back to the host. A failed capture is not harmless (it
    leaves the CUDA RNG mid-capture), so it is not attempted."""
    for module in model.modules():
        w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
        if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
            x = torch.empty(1, w13.shape[-1], dtype=w13.dtype, device=w13.device)
            if not grouped_mm_supported(x, w13, w2):
                return False
    return True
