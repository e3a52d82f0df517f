"""How the engine runs a model: the KV cache, the scheduler's limits, the parallel layout and its
modes, and the engine's own options (precision, captured decode, speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from epserve.config.model import ConfigError, ModelConfig


@dataclass(frozen=True)
class CacheConfig:
    """Paged latent KV cache. ``num_blocks=None`` sizes the pool from ``memory_budget_bytes``, else
    from ``memory_fraction`` of the device's total memory (vLLM's ``gpu_memory_utilization``: weights,
    KV cache and activation headroom together), else from ``memory_utilization`` of the memory free
    once the weights are loaded (``engine/memory.py``)."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int | None = None
    memory_fraction: float | None = None
    memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    kv_cache_dtype: KvCacheDtype = "auto"  # auto: the model dtype; fp8: e4m3 with a per-layer scale

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from {KV_CACHE_DTYPES}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: at most ``max_num_seqs`` running requests and
    ``max_num_batched_tokens`` tokens per step (prefill chunks share this budget with decodes)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None


# The modes of the parallel layout, declared once (the engine, the planner and the CLI take them from here).
OverlapMode = Literal["none", "dispatch", "microbatch"]  # a step's schedule (parallel/stages.py)
OverlapSetting = Literal["none", "dispatch", "microbatch", "auto"]  # auto: micro-batches above a threshold
# auto: local for EP 1, else all_to_all; symm_mem: CUDA with NVSHMEM (moe/dispatch/symm_mem.py)
DispatchBackend = Literal["auto", "local", "all_to_all", "padded", "symm_mem"]
DispatchDtype = Literal["auto", "fp8", "model", "nvfp4"]  # the dispatched rows: auto = model = the activation dtype
OVERLAP_MODES: tuple[str, ...] = get_args(OverlapMode)
OVERLAP_CHOICES: tuple[str, ...] = get_args(OverlapSetting)
DISPATCH_BACKENDS: tuple[str, ...] = get_args(DispatchBackend)
DISPATCH_DTYPES: tuple[str, ...] = get_args(DispatchDtype)
FIXED_SHAPE_DISPATCH: tuple[str, ...] = ("padded", "symm_mem")  # never sync with the host: decode can be captured
# symm_mem exchanges by rank with torch's NVSHMEM all_to_all_vdev, whose one 512-thread block scans the splits of
# every rank: any number of experts per rank, at most 512 ranks.
SYMM_MEM_MAX_RANKS = 512
MULTI_RANK_DISPATCH: tuple[str, ...] = ("all_to_all", "padded")  # the backends that exchange tokens between ranks
Quantization = Literal["auto", "fp8", None]  # weights: fp8 kept, None dequantized at load, auto: fp8 on CUDA
QUANTIZATIONS: tuple[str | None, ...] = get_args(Quantization)
KvCacheDtype = Literal["auto", "fp8"]  # the latent KV cache: the model dtype, or e4m3 with a per-layer scale
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
SpeculativeMethod = Literal["mtp", None]  # mtp: the checkpoint's multi-token prediction layer drafts tokens
SPECULATIVE_METHODS: tuple[str | None, ...] = get_args(SpeculativeMethod)


ReplicaSelection = Literal["position", "local"]  # how a token picks among an expert's replicas (moe/placement.py)
REPLICA_SELECTIONS: tuple[str, ...] = get_args(ReplicaSelection)
EngineRole = Literal["both", "prefill", "decode"]  # prefill/decode disaggregation (engine/kv_handoff.py)
ENGINE_ROLES: tuple[str, ...] = get_args(EngineRole)


@dataclass(frozen=True)
class LoopOptions:
    """How a rank's step loop (``engine/loop.py``) runs; a serving rank's come from its ``ServeOptions``."""

    drain_timeout_s: float = 30.0  # after a stop, running requests get this long before they are aborted
    stats_every: int = 64  # forward steps between expert-load gathers (also when going idle); 0: none
    step_timeout_s: float = 60.0  # a pass longer than this means a rank hung or died (the watchdog's limit)
    restarts: int = 0  # times the supervisor restarted this group (reported in the load figures)
    role: EngineRole = "both"  # reported in the load figures


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (vLLM's names). ``enabled``: every ``step_interval`` forward steps
    the ranks sum the expert load of the last ``window_size`` steps, place the experts (and the
    redundant slots' replicas) by it and move the weights that change place. ``replica_selection``:
    ``position`` spreads an expert's tokens evenly over its replicas, ``local`` prefers the sender's
    own rank, then node."""

    enabled: bool = False
    window_size: int = 1000
    step_interval: int = 3000
    replica_selection: ReplicaSelection = "position"

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"eplb {name} must be a positive integer, got {value!r}")
        if self.replica_selection not in REPLICA_SELECTIONS:
            raise ConfigError(f"unknown replica selection {self.replica_selection!r}; choose from {REPLICA_SELECTIONS}")


@dataclass(frozen=True)
class ParallelConfig:
    """Data-parallel attention groups × tensor-parallel ranks = expert-parallel world.

    ``dispatch``: the MoE token exchange (``auto`` = ``local`` for EP 1, else ``all_to_all``; ``symm_mem``:
    exact and capturable, CUDA with NVSHMEM only). ``dispatch_dtype``: the rows it sends, ``auto``/``model``
    in the activation dtype, ``fp8`` quantized as the FP8 expert GEMM would (needs FP8 expert weights),
    ``nvfp4`` as NVFP4 with a scale per token (lossy; needs NVFP4 expert weights: an NVFP4 checkpoint).
    ``overlap``: ``none``, ``dispatch`` (shared expert while the dispatch is in flight),
    ``microbatch`` (two interleaved micro-batches) or ``auto`` (micro-batches once every rank's FFN
    half has at least ``microbatch_threshold`` tokens; default: 256 on CUDA, never on CPU, where the
    collectives run on the cores the compute needs and micro-batching measured slower at every batch
    size, docs/benchmarks.md). ``nnodes``/``node_rank``/``master_addr``/``master_port``: a world spread
    over hosts, each running ``dp*tp/nnodes`` ranks; ``node_ip``: this host's address towards them
    (default: the one that routes to ``master_addr``, parallel/addresses.py). ``num_redundant_experts``:
    extra expert slots holding replicas of the busiest experts (placed by load when ``eplb`` rebalances)."""

    dp: int = 1
    tp: int = 1
    dispatch: DispatchBackend = "auto"
    dispatch_dtype: DispatchDtype = "auto"
    overlap: OverlapSetting = "auto"
    microbatch_threshold: int | None = None
    num_redundant_experts: int = 0
    eplb: EplbConfig = field(default_factory=EplbConfig)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    node_ip: str | None = None  # this host's address the peers reach (its interface carries gloo/NCCL)
    timeout_s: float = 600.0
    rendezvous_timeout_s: float = 60.0  # a rank gives up reaching the rank-0 store after this

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "nnodes", "microbatch_threshold"):
            value = getattr(self, name)
            if (value is not None or name != "microbatch_threshold") and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.dispatch not in DISPATCH_BACKENDS:
            raise ConfigError(f"unknown dispatch backend {self.dispatch!r}; choose from {DISPATCH_BACKENDS}")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ConfigError(f"unknown dispatch_dtype {self.dispatch_dtype!r}; choose from {DISPATCH_DTYPES}")
        if self.dispatch == "symm_mem" and self.world_size > SYMM_MEM_MAX_RANKS:
            raise ConfigError(f"dispatch 'symm_mem' (--dispatch symm_mem) takes at most {SYMM_MEM_MAX_RANKS} EP ranks "
                              f"(torch's all_to_all_vdev); dp*tp = {self.world_size}: use --dispatch padded")
        if self.dispatch == "local" and self.world_size > 1:
            raise ConfigError(f"dispatch 'local' needs EP = 1; dp*tp = {self.world_size}")
        if self.overlap not in OVERLAP_CHOICES:
            raise ConfigError(f"unknown overlap mode {self.overlap!r}; choose from {OVERLAP_CHOICES}")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ConfigError(f"num_redundant_experts must be an integer >= 0, got {self.num_redundant_experts!r}")
        if self.world_size % self.nnodes:
            raise ConfigError(f"dp*tp = {self.world_size} ranks do not divide over {self.nnodes} nodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} is outside [0, {self.nnodes})")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("a multi-node launch needs master_port (and master_addr of node 0)")
        if self.timeout_s <= 0 or self.rendezvous_timeout_s <= 0:
            raise ConfigError("timeout_s and rendezvous_timeout_s must be > 0")

    @property
    def fixed_shape_dispatch(self) -> bool:
        """Whether the MoE exchange never syncs with the host (EP 1, ``padded``, ``symm_mem``): decode can be
        captured."""
        return self.world_size == 1 or self.dispatch in FIXED_SHAPE_DISPATCH

    @property
    def ep(self) -> int:
        return self.dp * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def local_world_size(self) -> int:
        """Ranks on each host."""
        return self.world_size // self.nnodes

    def check_model(self, model: ModelConfig) -> None:
        """The layout must split the model evenly: heads over TP, experts over EP."""
        if model.num_attention_heads % self.tp:
            raise ConfigError(f"tp={self.tp} does not divide the model's {model.num_attention_heads} attention heads")
        experts = model.n_routed_experts + self.num_redundant_experts
        if not model.n_routed_experts and (self.eplb.enabled or self.num_redundant_experts):
            raise ConfigError("expert load balancing (enable_eplb, num_redundant_experts) needs routed experts; "
                              "the model has none")
        if model.n_routed_experts and experts % self.ep:
            raise ConfigError(
                f"EP = dp*tp = {self.ep} does not divide the {experts} routed experts "
                f"({model.n_routed_experts} + {self.num_redundant_experts} redundant)"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    model_path: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quantization: Quantization = "auto"
    cuda_graph: bool | None = None  # decode captured per batch bucket (engine/graphs.py); False: every step eager
    compile: bool = False
    cuda_graph_max_bs: int | None = None
    # None, the default: an engine of one rank whose checkpoint has an MTP layer measures at start-up whether MTP
    # pays (engine/spec_probe.py); its own config then says "mtp", or has 0 drafts
    speculative: SpeculativeMethod = None
    num_speculative_tokens: int = 1  # drafts per decode with ``speculative``, the MTP layer chained on itself; 0: off

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(f"unknown speculative method {self.speculative!r}; choose from {SPECULATIVE_METHODS}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ConfigError("num_speculative_tokens must be an integer >= 0 (0: no speculative decoding), got "
                              f"{self.num_speculative_tokens!r}")
        if self.num_spec_tokens and not self.model.num_nextn_predict_layers:
            raise ConfigError(f"speculative='mtp' needs MTP layers; the checkpoint at {self.model_path} has none "
                              "(num_nextn_predict_layers is 0)")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose from {QUANTIZATIONS}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.compile and self.device.startswith("cuda"):
            raise ConfigError("compile=True is the CPU's captured decode; on CUDA it is cuda_graph")
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise ConfigError("cuda_graph=True needs a CUDA device; on the CPU use compile=True")
        if (self.compile or self.cuda_graph) and not self.parallel.fixed_shape_dispatch:
            raise ConfigError("compile / cuda_graph with EP > 1 need a fixed-shape dispatch='padded' "
                              "(--dispatch padded) or, on CUDA, 'symm_mem'")
        if self.parallel.dispatch == "symm_mem" and not self.device.startswith("cuda"):
            raise ConfigError(f"dispatch 'symm_mem' (--dispatch symm_mem) runs on CUDA with NVSHMEM only; device is "
                              f"{self.device!r}: use --dispatch padded or all_to_all")
        self._check_dispatch_dtype()

    def _check_dispatch_dtype(self) -> None:
        """``dispatch_dtype='fp8'`` sends what the FP8 expert GEMM takes: refused when the routed experts'
        weights will not be FP8; ``'nvfp4'`` is refused for a checkpoint that is not NVFP4 (the runner checks
        the final word, ``moe/dispatch/payload.py``)."""
        if self.parallel.dispatch_dtype == "nvfp4" and not self.model.is_nvfp4:
            kind = "an FP8" if self.model.is_fp8 else "a bf16/fp32"
            raise ConfigError(f"dispatch_dtype='nvfp4' (--dispatch-dtype nvfp4) needs NVFP4 routed-expert weights; "
                              f"this is {kind} checkpoint, not a ModelOpt NVFP4 one. Make one with epserve "
                              "make-checkpoint --quantization nvfp4, or use --dispatch-dtype auto (or fp8)")
        if self.parallel.dispatch_dtype != "fp8":
            return
        why = None
        if self.quantization is None:
            why = "quantization=None dequantizes them"
        elif self.quantization == "auto" and not (self.device.startswith("cuda") and self.model.is_fp8):
            why = ("quantization='auto' keeps FP8 weights only for an FP8 checkpoint on CUDA (device "
                   f"{self.device!r}, checkpoint {'FP8' if self.model.is_fp8 else 'not FP8'})")
        if why:
            raise ConfigError(f"dispatch_dtype='fp8' (--dispatch-dtype fp8) needs FP8 routed-expert weights; {why}. "
                              "Use --quantization fp8 or --dispatch-dtype auto")

    @property
    def capture_mode(self) -> str | None:
        """``cuda_graph``, ``compile``, ``cpu_graph`` (the CPU's default on one rank) or None (every step eager;
        also with the all_to_all dispatcher and with ``cuda_graph=False``: ``--enforce-eager``). An NVFP4 checkpoint
        is captured too: its Triton kernels read the experts' counts on the device. The engine's runner has the
        last word, once its kernels are decided: eager where NVFP4 runs the torch reference instead (the Triton
        kernels failed their start-up self-test), which reads the counts on the host (``engine.runner``)."""
        if not self.parallel.fixed_shape_dispatch:
            return None
        if self.device.startswith("cuda"):
            return None if self.cuda_graph is False else "cuda_graph"
        if self.compile:
            return "compile"
        # one rank: its forward has no collective, so its C kernel calls record as one step (engine/graphs.py)
        return "cpu_graph" if self.cuda_graph is not False and self.parallel.world_size == 1 else None

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens verified per decode as configured (0 where ``speculative`` is None, the start-up probe's
        case, or ``num_speculative_tokens`` is 0)."""
        return self.num_speculative_tokens if self.speculative else 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model.max_position_embeddings
