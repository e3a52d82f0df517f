"""The operations of a decoder layer and the overlap schedules that order them, as data.

The engine runs these very ops (a layer's forward runs each through :func:`run_op`, which hands its
name to an :class:`OpHook` such as the per-op profiler) and the planner prices them; neither keeps a
private copy, and a test checks that the ops a layer actually runs, and where its forward yields,
equal these lists for every overlap mode. Pure Python, no torch.

A :class:`Schedule` is a list of :class:`Stage` s; a stage ends at a yield point. With one
micro-batch the stages simply run in order. With two, micro-batch B starts ``micro_batch_offset``
stages after A and the executor then alternates one stage of A, one stage of B, so one half
computes while the other's dispatch or combine is in flight (docs/architecture.md, "Two micro-batches")::

    A1 A2 A3 B1 A4 B2 A5 B3 A1' B4 A2' B5 ...

Communication is split into a ``send`` op (start the transfer) and a ``recv`` op (wait for it);
whatever runs between the two hides the transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol, TypeVar, get_args

from epserve.config import OVERLAP_MODES, OverlapMode

OpKind = Literal["gemm", "group_gemm", "attention", "dispatch", "combine", "collective", "other"]
OP_KINDS: tuple[str, ...] = get_args(OpKind)
Phase = Literal["decode", "prefill", "mixed"]  # mixed: the engine's batches of decodes and prefill chunks


@dataclass(frozen=True)
class Op:
    """One named operation of a layer. ``comm`` marks the two halves of an asynchronous transfer."""

    name: str
    kind: OpKind
    comm: Literal["send", "recv"] | None = None


@dataclass(frozen=True)
class Stage:
    """Operations that run back to back; the executor may switch micro-batch after the last one."""

    name: str
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: tuple[Stage, ...]
    num_micro_batches: int = 1
    micro_batch_offset: int = 0  # stages micro-batch B lags behind A

    @cached_property
    def ops(self) -> tuple[Op, ...]:
        return tuple(op for stage in self.stages for op in stage.ops)

    @cached_property
    def _position(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    def runs_before(self, first: Op, second: Op) -> bool:
        """Whether ``first`` runs before ``second`` in this schedule (both must be in it); a layer asks
        every step, so the order is computed once per schedule."""
        return self._position[first.name] < self._position[second.name]


T = TypeVar("T")


class OpHook(Protocol):
    """Wraps every op a layer runs: ``hook(op_name, fn, *args)`` must return ``fn(*args)``. The per-op
    profiler times it; a test records the names."""

    def __call__(self, name: str, fn: Callable[..., T], *args: Any) -> T: ...


def run_op(hook: OpHook | None, op: Op, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, through ``hook`` when there is one: how a layer's forward runs each of its ops."""
    return fn(*args) if hook is None else hook(op.name, fn, *args)


# ---- the operations ------------------------------------------------------------------------------
INPUT_NORM = Op("input_norm", "other")
QKV_A_PROJ = Op("qkv_a_proj", "gemm")  # q_a_proj fused with kv_a_proj_with_mqa (kv_a alone if q_lora_rank is null)
Q_B_PROJ = Op("q_b_proj", "gemm")  # q_a_layernorm -> q_b_proj (the plain q_proj if q_lora_rank is null)
APPEND_KV = Op("append_kv", "other")  # kv_a_layernorm, rotary embedding, write the latent cache
Q_ABSORB = Op("q_absorb", "gemm")  # decode: BMM with W_UK per head, query into the latent space
KV_B_PROJ = Op("kv_b_proj", "gemm")  # prefill: latent -> per-head K (nope part) and V
ATTENTION_CORE = Op("attention_core", "attention")  # decode: MQA over the latent cache; prefill: causal MHA
V_ABSORB = Op("v_absorb", "gemm")  # decode: BMM with W_UV per head, latent output -> v_head_dim
O_PROJ = Op("o_proj", "gemm")
ATTN_REDUCE_SCATTER = Op("attn_reduce_scatter", "collective")  # TP > 1: sum o_proj partials, keep 1/TP tokens
POST_NORM = Op("post_norm", "other")
GATE = Op("gate", "gemm")  # router logits, grouped top-k
DISPATCH_SEND = Op("dispatch_send", "dispatch", "send")
DISPATCH_RECV = Op("dispatch_recv", "dispatch", "recv")
SHARED_EXPERT = Op("shared_expert", "gemm")
EXPERTS = Op("experts", "group_gemm")  # grouped GEMM over the local experts (SwiGLU)
COMBINE_SEND = Op("combine_send", "combine", "send")
COMBINE_RECV = Op("combine_recv", "combine", "recv")
MLP = Op("mlp", "gemm")  # dense layers' SwiGLU MLP
FFN_ALL_GATHER = Op("ffn_all_gather", "collective")  # TP > 1: every TP rank gets all tokens back

EMBED = Op("embed", "other")
FINAL_NORM = Op("final_norm", "other")
LM_HEAD = Op("lm_head", "gemm")
SAMPLE = Op("sample", "other")
EH_PROJ = Op("eh_proj", "gemm")  # MTP: enorm/hnorm, concat, project [2H] -> [H]

_ATTN_PREP: dict[str, tuple[Op, ...]] = {
    "decode": (INPUT_NORM, QKV_A_PROJ, Q_B_PROJ, APPEND_KV, Q_ABSORB),
    "prefill": (INPUT_NORM, QKV_A_PROJ, Q_B_PROJ, APPEND_KV, KV_B_PROJ),
    "mixed": (INPUT_NORM, QKV_A_PROJ, Q_B_PROJ, APPEND_KV, Q_ABSORB, KV_B_PROJ),
}
_ATTN_CORE: dict[str, tuple[Op, ...]] = {
    "decode": (ATTENTION_CORE, V_ABSORB, O_PROJ, ATTN_REDUCE_SCATTER),
    "prefill": (ATTENTION_CORE, O_PROJ, ATTN_REDUCE_SCATTER),
    "mixed": (ATTENTION_CORE, V_ABSORB, O_PROJ, ATTN_REDUCE_SCATTER),
}

# Operations run once per step outside the decoder layers, and once per MTP draft token.
HEAD_OPS: tuple[Op, ...] = (EMBED, FINAL_NORM, LM_HEAD, SAMPLE)
MTP_DRAFT_OPS: tuple[Op, ...] = (EMBED, EH_PROJ, FINAL_NORM, LM_HEAD, SAMPLE)


def attention_ops(phase: Phase = "decode") -> tuple[Op, ...]:
    """The attention half of every layer: absorbed MLA for decode, MHA form for prefill."""
    return _ATTN_PREP[phase] + _ATTN_CORE[phase]


def ffn_op_names() -> frozenset[str]:
    """The ops of the FFN half of a layer (after the attention's reduce-scatter, up to the
    all-gather): they run on the tokens a TP rank owns, not on the DP group's."""
    attention = {op.name for phase in ("decode", "prefill") for op in attention_ops(phase)}  # type: ignore[arg-type]
    layers = [moe_layer_schedule(m) for m in OVERLAP_MODES] + [dense_layer_schedule()]
    return frozenset(op.name for s in layers for op in s.ops if op.name not in attention)


def dense_layer_schedule(phase: Phase = "decode") -> Schedule:
    """Dense layers (the first ``first_k_dense_replace``) always run the whole batch in order."""
    ops = attention_ops(phase) + (POST_NORM, MLP, FFN_ALL_GATHER)
    return Schedule("dense", (Stage("layer", ops),))


def moe_layer_schedule(mode: OverlapMode = "dispatch", phase: Phase = "decode") -> Schedule:
    """The stage list of one MoE layer under an overlap mode.

    - ``none``: every transfer is waited for right after it starts;
    - ``dispatch``: the shared expert runs while the dispatch is in flight;
    - ``microbatch``: the five stages of docs/architecture.md ("Two micro-batches"), two micro-batches
      offset by two stages.
    """
    prep, core = _ATTN_PREP[phase], _ATTN_CORE[phase]
    route = (POST_NORM, GATE)
    if mode == "none":
        ops = prep + core + route + (DISPATCH_SEND, DISPATCH_RECV, EXPERTS, COMBINE_SEND, COMBINE_RECV)
        return Schedule("none", (Stage("layer", ops + (SHARED_EXPERT, FFN_ALL_GATHER)),))
    if mode == "dispatch":
        ops = prep + core + route + (DISPATCH_SEND, SHARED_EXPERT, DISPATCH_RECV, EXPERTS)
        return Schedule("dispatch", (Stage("layer", ops + (COMBINE_SEND, COMBINE_RECV, FFN_ALL_GATHER)),))
    if mode == "microbatch":
        stages = (
            Stage("attn_prep", prep),
            Stage("attn_core", core + route),
            Stage("dispatch_shared", (DISPATCH_SEND, SHARED_EXPERT)),
            Stage("experts", (DISPATCH_RECV, EXPERTS, COMBINE_SEND)),
            Stage("combine", (COMBINE_RECV, FFN_ALL_GATHER)),
        )
        return Schedule("microbatch", stages, num_micro_batches=2, micro_batch_offset=2)
    raise ValueError(f"unknown overlap mode {mode!r}; expected one of {OVERLAP_MODES}")
