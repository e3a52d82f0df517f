"""The checkpoint's model: ``ModelConfig.from_hf(dir)`` is the only place that reads a Hugging Face
``config.json``; model code reads paper-named fields and derived properties from here and never
touches the raw dict."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
SUPPORTED_TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
SUPPORTED_SCORING = ("sigmoid", "softmax")
SUPPORTED_QUANT_ALGOS = ("NVFP4",)  # ModelOpt checkpoints (``quant_method: "modelopt"``)
NVFP4_GROUP_SIZE = 16
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's quantization file, beside config.json


class ConfigError(ValueError):
    """A checkpoint or option the engine cannot serve; the message names the problem."""


class OutOfMemoryError(RuntimeError):
    """The weights (or a single request) cannot fit in the memory budget (``engine/memory.py``)."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rotary scaling as published in DeepSeek-V3's ``rope_scaling``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V2/V3 model dimensions under their paper names."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rope_interleave: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    fp8_block_size: tuple[int, int] | None = None
    fp8_scale_fmt: str | None = None  # quantization_config.scale_fmt (e.g. "ue8m0": power-of-two scales)
    nvfp4_group_size: int | None = None  # ModelOpt NVFP4: values per e4m3 block scale (always 16)
    nvfp4_exclude: tuple[str, ...] = ()  # ModelOpt's exclude_modules: wildcard patterns of unquantized modules

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent cache: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def is_fp8(self) -> bool:
        return self.fp8_block_size is not None

    @property
    def is_nvfp4(self) -> bool:
        """A ModelOpt NVFP4 checkpoint: modules outside ``nvfp4_exclude`` (``checkpoint.nvfp4.is_excluded``)
        store four-bit weights with their scales."""
        return self.nvfp4_group_size is not None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a checkpoint directory (or the file itself), and ModelOpt's
        ``hf_quant_config.json`` when it lies beside it."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"model path does not exist: {path}")
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        hf_quant = None
        if (quant_file := cfg_file.parent / HF_QUANT_CONFIG).is_file():
            try:
                hf_quant = json.loads(quant_file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{quant_file} is not valid JSON: {e}") from None
        return cls.from_dict(raw, hf_quant)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], hf_quant_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a ``config.json`` dict (and the ``hf_quant_config.json`` dict of a ModelOpt export)."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ConfigError(f"unsupported architecture {archs or raw.get('model_type')!r}; supported: {supported}")
        is_v3 = arch == "DeepseekV3ForCausalLM"

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ConfigError(f"config.json lacks required field {key!r}")
            return raw[key]

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        if raw.get("attention_bias"):
            raise ConfigError("unsupported attention_bias=true")
        n_routed = int(raw.get("n_routed_experts") or 0)
        scoring = raw.get("scoring_func", "sigmoid" if is_v3 else "softmax")
        if scoring not in SUPPORTED_SCORING:
            raise ConfigError(f"unsupported scoring_func {scoring!r}; supported: {SUPPORTED_SCORING}")
        topk_method = raw.get("topk_method", "noaux_tc" if is_v3 else "greedy")
        if topk_method not in SUPPORTED_TOPK_METHODS:
            raise ConfigError(f"unsupported topk_method {topk_method!r}; supported: {SUPPORTED_TOPK_METHODS}")
        n_group = int(raw.get("n_group") or 1)
        topk_group = int(raw.get("topk_group") or n_group)
        if n_routed:
            if n_routed % n_group:
                raise ConfigError(f"n_routed_experts={n_routed} is not divisible by n_group={n_group}")
            if not 1 <= topk_group <= n_group:
                raise ConfigError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
            topk = int(need("num_experts_per_tok"))
            if topk > n_routed or (topk_method != "greedy" and topk > topk_group * (n_routed // n_group)):
                raise ConfigError(f"num_experts_per_tok={topk} exceeds the experts the groups allow")

        rope_theta, rope_scaling = _parse_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

        block, scale_fmt, nvfp4 = None, None, (None, ())
        quant = raw.get("quantization_config")
        if hf_quant_config is not None or (quant and quant.get("quant_method") == "modelopt"):
            nvfp4 = _parse_modelopt(quant, hf_quant_config)
        elif quant:
            method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
            if method != "fp8" or fmt != "e4m3":
                raise ConfigError(f"unsupported quantization {method!r}/{fmt!r}; only fp8 e4m3 block scales")
            if quant.get("activation_scheme", "dynamic") != "dynamic":
                raise ConfigError("unsupported FP8 activation_scheme; only 'dynamic'")
            block = tuple(int(b) for b in quant.get("weight_block_size", (128, 128)))
            scale_fmt = quant.get("scale_fmt")

        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            n_routed_experts=n_routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(raw.get("rope_interleave", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            fp8_block_size=block,  # type: ignore[arg-type]
            fp8_scale_fmt=scale_fmt,
            nvfp4_group_size=nvfp4[0],
            nvfp4_exclude=nvfp4[1],
        )


def _modelopt_fields(q: Any, where: str) -> tuple[Any, Any, Any]:
    """(quant_algo, group_size, exclude_modules) of ModelOpt's nested form: ``{"quantization": {...}}``."""
    if not isinstance(q, dict):
        raise ConfigError(f"{where} lacks the 'quantization' section ModelOpt writes")
    return q.get("quant_algo"), q.get("group_size", NVFP4_GROUP_SIZE), q.get("exclude_modules")


def _parse_modelopt(quant: dict[str, Any] | None, hf_quant: dict[str, Any] | None) -> tuple[int, tuple[str, ...]]:
    """ModelOpt's quantization, from ``hf_quant_config.json`` and/or config.json's ``quantization_config``
    (nested like the file, or flat as ModelOpt restates it: ``quant_algo``, ``ignore``, ``config_groups``):
    (group size, exclude patterns). Both present must agree; only NVFP4 with groups of 16 is served."""
    sources = []
    if hf_quant is not None:
        sources.append((HF_QUANT_CONFIG, *_modelopt_fields(hf_quant.get("quantization"), HF_QUANT_CONFIG)))
    if quant:
        where = "config.json quantization_config"
        if quant.get("quant_method", "modelopt") != "modelopt":
            raise ConfigError(f"{HF_QUANT_CONFIG} (ModelOpt) disagrees with {where}.quant_method "
                              f"{quant.get('quant_method')!r}")
        if "quantization" in quant:
            sources.append((where, *_modelopt_fields(quant["quantization"], where)))
        else:
            groups = quant.get("config_groups") or {}
            sizes = {(g.get("weights") or {}).get("group_size", NVFP4_GROUP_SIZE) for g in groups.values()}
            if len(sizes) > 1:
                raise ConfigError(f"{where}.config_groups mix weight group_size values {sorted(sizes)}")
            group = sizes.pop() if sizes else NVFP4_GROUP_SIZE
            sources.append((where, quant.get("quant_algo"), group, quant.get("ignore")))
    (where, algo, group, exclude), *others = sources
    if algo not in SUPPORTED_QUANT_ALGOS:
        raise ConfigError(f"unsupported quant_algo {algo!r} in {where}; supported: {', '.join(SUPPORTED_QUANT_ALGOS)}")
    if group != NVFP4_GROUP_SIZE:
        raise ConfigError(f"unsupported NVFP4 group_size {group!r} in {where}; NVFP4 scales groups of "
                          f"{NVFP4_GROUP_SIZE} values")
    exclude = exclude or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError(f"exclude_modules in {where} must be a list of module name patterns, got {exclude!r}")
    for other, o_algo, o_group, o_exclude in others:
        for field, mine, theirs in (("quant_algo", algo, o_algo), ("group_size", group, o_group),
                                    ("exclude_modules", sorted(exclude), sorted(o_exclude or []))):
            if mine != theirs:
                raise ConfigError(f"{field} {mine!r} in {where} disagrees with {theirs!r} in {other}")
    return int(group), tuple(exclude)


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Accept ``rope_scaling`` (as published) or ``rope_parameters`` (as transformers 5 writes it)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"unsupported rotary scaling {kind!r}; supported: yarn")
    orig = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if orig is None:
        raise ConfigError("yarn rope scaling lacks original_max_position_embeddings")
    if factor is None:
        factor = raw.get("max_position_embeddings", orig) / orig
    return theta, RopeScaling(
        factor=float(factor), original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 1.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
    )
