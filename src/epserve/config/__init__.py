"""Frozen configuration dataclasses, built once: the checkpoint's model (``model``) and how the engine
runs it (``engine``), with the mode types declared once."""

from epserve.config.engine import (
    DISPATCH_BACKENDS,
    ENGINE_ROLES,
    KV_CACHE_DTYPES,
    MULTI_RANK_DISPATCH,
    OVERLAP_CHOICES,
    OVERLAP_MODES,
    QUANTIZATIONS,
    REPLICA_SELECTIONS,
    SPECULATIVE_METHODS,
    CacheConfig,
    DispatchBackend,
    EngineConfig,
    EngineRole,
    EplbConfig,
    KvCacheDtype,
    LoopOptions,
    OverlapMode,
    OverlapSetting,
    ParallelConfig,
    Quantization,
    ReplicaSelection,
    SchedulerConfig,
    SpeculativeMethod,
)
from epserve.config.model import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_SCORING,
    SUPPORTED_TOPK_METHODS,
    ConfigError,
    ModelConfig,
    OutOfMemoryError,
    RopeScaling,
    yarn_get_mscale,
)

__all__ = [
    "DISPATCH_BACKENDS", "ENGINE_ROLES", "KV_CACHE_DTYPES", "MULTI_RANK_DISPATCH", "OVERLAP_CHOICES", "OVERLAP_MODES",
    "QUANTIZATIONS", "REPLICA_SELECTIONS", "SPECULATIVE_METHODS", "SUPPORTED_ARCHITECTURES", "SUPPORTED_SCORING",
    "SUPPORTED_TOPK_METHODS", "CacheConfig", "ConfigError", "OutOfMemoryError", "DispatchBackend", "EngineConfig",
    "EngineRole", "EplbConfig", "KvCacheDtype", "LoopOptions", "ModelConfig", "OverlapMode", "OverlapSetting",
    "ParallelConfig", "Quantization", "ReplicaSelection", "RopeScaling", "SchedulerConfig", "SpeculativeMethod",
    "yarn_get_mscale",
]
