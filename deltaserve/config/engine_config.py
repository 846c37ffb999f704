"""The engine's own options, validated once when they are parsed.

Names follow vLLM's `LLM(...)` / `EngineArgs` so that users' code and command lines carry over.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from deltaserve.config.parallel import ParallelConfig
from deltaserve.core.checkpoint_grid import checkpoint_grid

EXECUTOR_BACKENDS = ("uniproc", "mp")  # deltaserve.executor's registry; checked there at import
_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: int | str | None, what: str = "cache_memory") -> int | None:
    """`1073741824`, `"1GiB"`, `"512MB"` -> bytes."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"{what}={value} must be a positive number of bytes")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"{what}={value!r} is not a size; write e.g. 2000000000, 2GB or 2GiB")
    num = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if num <= 0:
        raise ValueError(f"{what}={value!r} must be a positive number of bytes")
    return num


def json_object(value: str | dict[str, Any], what: str) -> dict[str, Any]:
    """An option given as JSON text or a dict (--kv-transfer-config, --speculative-config), as a dict;
    ValueError naming `what` when it is not valid JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


OFFLOADING_ADMISSIONS = ("all", "cache_control")  # kv_offloading_admission


@dataclass
class EngineConfig:
    """Everything `LLM(...)` and `deltaserve generate/serve` accept besides sampling."""

    model: str | None = None
    tokenizer: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # prefill tokens a step may take while it also decodes (0: up to max_num_batched_tokens), so a long
    # prompt's chunk slows the running requests' next token by a bounded amount
    max_prefill_tokens_with_decodes: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # override the sized number of KV blocks (tests, debugging)
    enforce_eager: bool = False
    max_logprobs: int = 20
    enable_prefix_caching: bool = True
    state_checkpoint_interval: int | None = None  # tokens between rungs; None: about one image's worth of KV
    state_checkpoint_fraction: float = 0.25  # of the cache left after live state slots, for checkpoints
    state_checkpoint_unit_bytes: int | None = None  # None: min(image, 1 MiB)
    # two steps in flight: the next step is scheduled while the device runs this one. None: on where it
    # was measured to pay (CUDA), off on the CPU, where a step runs inside the call that launches it
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # batches in flight through the pipeline (pipeline_parallel_size > 1); 0: one per stage
    pp_max_inflight: int = 0
    # decode context parallelism (vLLM's names): groups of this many TP ranks split each request's MLA
    # latents, token t on DCP rank (t // interleave) % size; it divides tensor_parallel_size
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1  # divides block_size
    # expert parallelism (vLLM's name): each TP rank holds num_experts / tensor_parallel_size whole routed
    # experts instead of a slice of every expert; no effect at tensor_parallel_size=1 (as in vLLM)
    enable_expert_parallel: bool = False
    # "uniproc" (everything in this process) or "mp" (one process per rank); None: "mp" when
    # tensor_parallel_size x pipeline_parallel_size > 1, else "uniproc"
    distributed_executor_backend: str | None = None
    # several nodes (vLLM's names): node `node_rank` of `nnodes` runs world_size / nnodes ranks; the
    # head (node_rank 0) runs the engine, the others only ranks; all meet at master_addr:master_port
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # per-GPU NUMA nodes, "0,0,1,1": each rank binds its CPUs to the node of its local GPU index
    numa_bind: str | None = None
    # prefill/decode disaggregation (vLLM's --kv-transfer-config): a KVTransferConfig, its JSON text or a
    # dict, e.g. {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}; None: no KV connector
    kv_transfer_config: Any = None
    # the offload tier (deltaserve/offload) behind the prefix cache: KV chunks and KDA state images in
    # host memory (kv_offloading_size, summed over the ranks, as vLLM's), on disk (a directory and its
    # size, summed over the ranks) and in a Mooncake Store (mooncake://MASTER:PORT); any of them turns
    # it on. Chunks of kv_offloading_chunk_size tokens; at most kv_offloading_max_pending_saves saves in
    # flight (None: twice the pipeline stage count)
    kv_offloading_size: int | str | None = None
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: int | str | None = None
    kv_offloading_remote: str | None = None
    kv_offloading_chunk_size: int = 256
    kv_offloading_max_pending_saves: int | None = None
    # which requests the tier saves: "all" (write-through of every checkpoint), or "cache_control": only
    # those whose SamplingParams.extra_args carry a cache_control hint (the client marks the conversations
    # it will come back to; the others stay in HBM's prefix cache only)
    kv_offloading_admission: str = "all"
    # speculative decoding (vLLM's speculative_config): a SpeculativeConfig, its JSON text or a dict, e.g.
    # {"method": "ngram", "num_speculative_tokens": 3}; None: every step decodes one token per request
    speculative_config: Any = None
    parallel: ParallelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(str(self.dtype), str(self.dtype))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {', '.join(_DTYPES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two (e.g. 16)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if not isinstance(self.max_prefill_tokens_with_decodes, int) or self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes={self.max_prefill_tokens_with_decodes!r} must be a "
                             "non-negative integer (0: no bound beyond max_num_batched_tokens)")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be >= 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")
        self._check_dcp_options()
        self._check_offloading()
        grid = self.checkpoint_grid
        if self.state_checkpoint_interval is not None and (
            self.state_checkpoint_interval < 1 or self.state_checkpoint_interval % grid
        ):
            dcp = (f" x decode_context_parallel_size={self.decode_context_parallel_size}"
                   if self.decode_context_parallel_size > 1 else "")
            offload = (f", kv_offloading_chunk_size={self.kv_offloading_chunk_size}" if self.offloading_enabled
                       else "")
            raise ValueError(
                f"state_checkpoint_interval={self.state_checkpoint_interval} must be a positive multiple of the "
                f"checkpoint grid, {grid} tokens (block_size={self.block_size}{dcp}{offload} and fla's chunk of 64)"
            )
        if not 0.0 <= self.state_checkpoint_fraction <= 0.9:
            raise ValueError(f"state_checkpoint_fraction={self.state_checkpoint_fraction} must be in [0, 0.9]")
        if self.state_checkpoint_unit_bytes is not None and self.state_checkpoint_unit_bytes < 1:
            raise ValueError(f"state_checkpoint_unit_bytes={self.state_checkpoint_unit_bytes} must be positive")
        self.cache_memory = parse_bytes(self.cache_memory)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self._check_parallel_options()
        self._check_node_options()
        self._check_kv_transfer()
        self._check_speculative()
        self.parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
        )

    def _check_dcp_options(self) -> None:
        dcp, interleave = self.decode_context_parallel_size, self.dcp_kv_cache_interleave_size
        for name, value in (("decode_context_parallel_size", dcp), ("dcp_kv_cache_interleave_size", interleave)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.tensor_parallel_size % dcp:
            raise ValueError(
                f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={self.tensor_parallel_size}: "
                "a DCP group is made of TP ranks (it adds no ranks)"
            )
        if self.block_size % interleave:
            raise ValueError(f"dcp_kv_cache_interleave_size={interleave} must divide block_size={self.block_size}")

    @property
    def offloading_enabled(self) -> bool:
        """Whether an offload tier is configured (host memory, disk or a Mooncake Store)."""
        return bool(self.kv_offloading_size or self.kv_offloading_disk_path or self.kv_offloading_remote)

    @property
    def checkpoint_grid(self) -> int:
        """Tokens between checkpoint places: the block (times DCP) and fla's chunk, and the offload
        chunk when the tier is on (every anchor and rung must be storable beside its KV chunk)."""
        return checkpoint_grid(self.scheduler_block_size,
                               coarser=self.kv_offloading_chunk_size if self.offloading_enabled else 1)

    @property
    def offloading_max_pending_saves(self) -> int:
        """kv_offloading_max_pending_saves as given, else twice the pipeline stage count."""
        return self.kv_offloading_max_pending_saves or 2 * self.pipeline_parallel_size

    def _check_offloading(self) -> None:
        self.kv_offloading_size = parse_bytes(self.kv_offloading_size, "kv_offloading_size")
        self.kv_offloading_disk_size = parse_bytes(self.kv_offloading_disk_size, "kv_offloading_disk_size")
        chunk, bs = self.kv_offloading_chunk_size, self.scheduler_block_size
        if not isinstance(chunk, int) or chunk < 1 or chunk % bs:
            dcp = (f" x decode_context_parallel_size={self.decode_context_parallel_size}"
                   if self.decode_context_parallel_size > 1 else "")
            raise ValueError(f"kv_offloading_chunk_size={chunk!r} must be a positive multiple of the block, "
                             f"{bs} tokens (block_size={self.block_size}{dcp})")
        pending = self.kv_offloading_max_pending_saves
        if pending is not None and (not isinstance(pending, int) or pending < 1):
            raise ValueError(f"kv_offloading_max_pending_saves={pending!r} must be a positive integer (unset: "
                             "twice the pipeline stage count)")
        if self.kv_offloading_admission not in OFFLOADING_ADMISSIONS:
            raise ValueError(f"kv_offloading_admission={self.kv_offloading_admission!r} must be one of "
                             f"{', '.join(OFFLOADING_ADMISSIONS)}")
        if (self.kv_offloading_disk_path is None) != (self.kv_offloading_disk_size is None):
            raise ValueError("kv_offloading_disk_path and kv_offloading_disk_size go together: the directory of "
                             "the disk tier and the bytes it may take (summed over the ranks)")
        if self.kv_offloading_remote is not None:
            from deltaserve.offload.mooncake_tier import parse_master_address

            parse_master_address(self.kv_offloading_remote)
        if self.offloading_enabled and not self.enable_prefix_caching:
            raise ValueError("the offload tier (kv_offloading_size / kv_offloading_disk_path / kv_offloading_remote) "
                             "stores prefix-cache KV and state checkpoints: it needs enable_prefix_caching")

    def _check_speculative(self) -> None:
        if self.speculative_config is None:
            return
        from deltaserve.config.speculative import SpeculativeConfig

        spec = self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if spec.method == "draft_model" and self.decode_context_parallel_size > 1:
            raise ValueError(f"speculative_config: method 'draft_model' does not run under decode context "
                             f"parallelism yet (decode_context_parallel_size={self.decode_context_parallel_size}); "
                             "use method 'ngram' or decode_context_parallel_size=1")
        if self.async_scheduling:
            # the next step's verify window starts from the tokens the previous step accepted, which the
            # scheduler learns only when that step's output is applied
            raise ValueError("async_scheduling=True is not supported with speculative_config: a verify step "
                             "needs the previous step's accepted tokens before it is scheduled; set "
                             "async_scheduling=False (or leave it unset) or drop speculative_config")

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts verified per request and step: 0 without speculative decoding, and on a P/D producer,
        which never speculates (its requests end after their first token)."""
        transfer = self.kv_transfer_config
        if self.speculative_config is None or (transfer is not None and transfer.is_producer):
            return 0
        return self.speculative_config.num_speculative_tokens

    @property
    def scheduler_block_size(self) -> int:
        """Tokens one scheduler block covers: block_size x decode_context_parallel_size (each DCP rank's
        page holds block_size of them)."""
        return self.block_size * self.decode_context_parallel_size

    def _check_kv_transfer(self) -> None:
        if self.kv_transfer_config is None:
            return
        from deltaserve.kv_transfer.config import KVTransferConfig

        transfer = self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        sizes = (f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                 f"{self.pipeline_parallel_size}, decode_context_parallel_size={self.decode_context_parallel_size}")
        if transfer.is_consumer and self.pipeline_parallel_size > 1:
            raise ValueError(f"kv_transfer_config: a {transfer.kv_role} (decode) engine cannot run pipeline "
                             f"parallel ({sizes}): run the decode as TP x DCP, pipeline_parallel_size=1")
        if transfer.is_producer and self.decode_context_parallel_size > 1:
            raise ValueError(f"kv_transfer_config: a {transfer.kv_role} (prefill) engine cannot run decode "
                             f"context parallelism ({sizes}): run the prefill as PP x TP, "
                             "decode_context_parallel_size=1")

    def _check_parallel_options(self) -> None:
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} is unknown; choose one of "
                             f"{', '.join(EXECUTOR_BACKENDS)} (or leave it unset)")
        if backend == "uniproc" and world > 1:
            raise ValueError(
                f"distributed_executor_backend='uniproc' runs one rank, but tensor_parallel_size="
                f"{self.tensor_parallel_size} x pipeline_parallel_size={self.pipeline_parallel_size} = {world} "
                "ranks; use distributed_executor_backend='mp' (or leave it unset)"
            )
        if not isinstance(self.pp_max_inflight, int) or self.pp_max_inflight < 0:
            raise ValueError(f"pp_max_inflight={self.pp_max_inflight!r} must be a non-negative integer "
                             "(0: one batch per pipeline stage)")
        if self.pp_max_inflight > 1 and self.pipeline_parallel_size == 1:
            raise ValueError(
                f"pp_max_inflight={self.pp_max_inflight} needs pipeline_parallel_size > 1 (it is 1): batches "
                "in flight through a pipeline; set pipeline_parallel_size or leave pp_max_inflight at 0"
            )
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            # a decode's placeholder is filled from the token its previous step sampled, which only the
            # last stage holds; under PP the batch queue keeps several batches in flight instead
            raise ValueError(
                f"async_scheduling=True is not supported with pipeline_parallel_size="
                f"{self.pipeline_parallel_size}: under pipeline parallelism several batches are in flight "
                "through the stages (pp_max_inflight) and a decode waits for its token; set "
                "async_scheduling=False (or leave it unset) or pipeline_parallel_size=1"
            )

    def _check_node_options(self) -> None:
        """nnodes / node_rank / master_addr / master_port / numa_bind (see the fields)."""
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        for name in ("nnodes", "node_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name == "nnodes" else 0):
                raise ValueError(f"{name}={value!r} must be a {'positive' if name == 'nnodes' else 'non-negative'} "
                                 "integer")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes} (nodes are numbered "
                             f"0 to {self.nnodes - 1}; node 0 runs the engine)")
        if self.master_port is not None and not (isinstance(self.master_port, int) and 0 < self.master_port < 65533):
            raise ValueError(f"master_port={self.master_port!r} must be a TCP port below 65533 (it and the next "
                             "three ports are used)")
        if self.nnodes > 1:
            if world % self.nnodes or (world // self.nnodes) % self.tensor_parallel_size:
                raise ValueError(
                    f"nnodes={self.nnodes} must divide tensor_parallel_size={self.tensor_parallel_size} x "
                    f"pipeline_parallel_size={self.pipeline_parallel_size} = {world} ranks into whole pipeline "
                    "stages per node (a TP group never spans nodes): make pipeline_parallel_size a multiple of "
                    "nnodes"
                )
            if self.master_addr is None or self.master_port is None:
                raise ValueError(f"nnodes={self.nnodes} needs master_addr and master_port (the head node's "
                                 "address, and a port from which four are free there)")
            if self.distributed_executor_backend == "uniproc":
                raise ValueError("distributed_executor_backend='uniproc' runs on one node; with nnodes > 1 use "
                                 "'mp' (or leave it unset)")
        if self.numa_bind is not None:
            from deltaserve.distributed.placement import parse_numa_bind

            per_node = world // self.nnodes
            entries = parse_numa_bind(self.numa_bind)
            if len(entries) < per_node:
                raise ValueError(
                    f"numa_bind={self.numa_bind!r} has {len(entries)} entries but each node runs {per_node} ranks "
                    f"(tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_size="
                    f"{self.pipeline_parallel_size} / nnodes={self.nnodes}); give one NUMA node per GPU"
                )
            if world == 1 and self.distributed_executor_backend != "mp":
                raise ValueError("numa_bind binds rank processes: with one rank set "
                                 "distributed_executor_backend='mp'")

    @property
    def executor_backend(self) -> str:
        """The executor the engine runs: distributed_executor_backend, or by world size."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.parallel.world_size > 1 or self.nnodes > 1 else "uniproc"

    @property
    def batches_in_flight(self) -> int:
        """How many batches the pipeline keeps in flight: pp_max_inflight, 0 meaning one per stage."""
        return self.pp_max_inflight or self.pipeline_parallel_size

    def resolve_async_scheduling(self, device_type: str) -> bool:
        """Whether the engine keeps two steps in flight on a device of this type (never under PP,
        whose batch queue keeps its own batches in flight)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda" and self.pipeline_parallel_size == 1 and self.speculative_config is None

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]
