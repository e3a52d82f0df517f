"""DeepSeek MoE layer: gate -> dispatcher -> grouped experts -> combine, plus the shared expert.

:meth:`MoE.forward` reads top to bottom like DeepSeek's reference ``MoE.forward``, with the
dispatcher's send/receive halves around the overlap points, and yields where another micro-batch may
run while a transfer is in flight (``parallel/stages.py``, the micro-batch schedule).
"""

from __future__ import annotations

import torch
from torch import nn

from epserve.config import ModelConfig
from epserve.kernels import add
from epserve.kernels.ops import index_add_counts
from epserve.model.layers import GatedMLP
from epserve.model.quantization import nvfp4_quantized
from epserve.model.streams import Forked, SideStream
from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput
from epserve.moe.experts import GroupedExperts
from epserve.moe.gate import ExpertGate
from epserve.moe.placement import ExpertPlacement, select_replicas
from epserve.parallel.overlap import Result, Stages
from epserve.parallel.stages import (
    COMBINE_RECV,
    COMBINE_SEND,
    DISPATCH_RECV,
    DISPATCH_SEND,
    EXPERTS,
    GATE,
    SHARED_EXPERT,
    OpHook,
    run_op,
)

ROUTING_BUFFERS = ("replica_table", "replica_count", "slot_experts")  # the buffers a placement determines


class MoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dispatcher: Dispatcher,
        placement: ExpertPlacement,
        ep_rank: int = 0,
        fp8: bool = False,
        layer_idx: int | None = None,
    ) -> None:
        """``layer_idx``: the checkpoint's layer, which says whether an NVFP4 checkpoint stores the routed and the
        shared experts in four bits (``model.quantization.nvfp4_quantized``; None: neither)."""
        super().__init__()
        p = f"model.layers.{layer_idx}.mlp."
        nvfp4_routed = layer_idx is not None and nvfp4_quantized(config, p + "experts.0.gate_proj")
        nvfp4_shared = layer_idx is not None and nvfp4_quantized(config, p + "shared_experts.gate_proj")
        self.gate = ExpertGate(config)
        self.dispatcher = dispatcher
        self.ep_rank = ep_rank
        self.placement = placement
        self.experts = GroupedExperts(placement.num_local_slots, config.hidden_size, config.moe_intermediate_size, fp8,
                                      nvfp4=nvfp4_routed)
        # Routing state, replaced in place by a rebalance (a captured graph keeps reading the same storage):
        # replica_table [E, max_replicas] candidate slots, replica_count [E] candidates to spread over,
        # slot_experts [local slots] the logical expert of each.
        for name, t in zip(ROUTING_BUFFERS, self._routing(placement)):
            self.register_buffer(name, t, persistent=False)
        # Token copies this rank's slots received per logical expert since start-up (or the last reset),
        # counted on the device (no sync per layer); a placement change does not disturb it. A captured
        # bucket's padding rows are not requests' tokens: on one rank they are left out (``forward``).
        self.expert_load = torch.zeros(placement.num_logical_experts, dtype=torch.long)
        self.side_stream = SideStream()  # the shared expert beside dispatch and routed experts, on CUDA
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, fp8, nvfp4_shared)
            if config.n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, result: Result[torch.Tensor], shared_during_dispatch: bool = True,
        hook: OpHook | None = None, real_rows: torch.Tensor | None = None,
    ) -> Stages:
        """x [T, H] (this TP rank's normed tokens) -> ``result.value``: the routed experts' weighted sum
        plus the shared expert [T, H]. ``shared_during_dispatch``: compute the shared expert while the
        dispatch is in flight (else after the combine). ``real_rows`` [T] bool: False at a captured bucket's
        padding rows (None: every row a request's), whose token copies :attr:`expert_load` leaves out. Yields
        after the gate, after the dispatch is sent, after the combine is sent: the ends of the micro-batch
        schedule's stages 2-4 (``parallel/overlap.py``)."""
        topk_ids, topk_weights = run_op(hook, GATE, self.route, x)
        yield
        sent = run_op(hook, DISPATCH_SEND, self.dispatcher.dispatch_send, x, topk_ids, topk_weights, real_rows)
        if shared_during_dispatch:  # on CUDA on a second stream, joined before the sum (timed in place)
            if hook is None:
                forked = self.side_stream.start(self.shared_expert, x)
            else:
                forked = Forked(run_op(hook, SHARED_EXPERT, self.shared_expert, x))
        yield
        expert_input, route = run_op(hook, DISPATCH_RECV, self._dispatch_recv, sent, topk_ids, real_rows)
        y = run_op(hook, EXPERTS, self.experts, expert_input)
        combining = run_op(hook, COMBINE_SEND, self.dispatcher.combine_send, y, route)
        yield
        out = run_op(hook, COMBINE_RECV, self.dispatcher.combine_recv, combining)
        if shared_during_dispatch:
            shared = self.side_stream.join(forked)
        else:
            shared = run_op(hook, SHARED_EXPERT, self.shared_expert, x)
        result.value = out if shared is None else add(out, shared)

    def init_buffers(self) -> None:
        """The routing tables, computed (not loaded): after building on the meta device."""
        device = self.gate.weight.device
        for name, t in zip(ROUTING_BUFFERS, self._routing(self.placement)):
            setattr(self, name, t.to(device))
        self.expert_load = torch.zeros(self.expert_load.shape, dtype=torch.long, device=device)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from now on (its weights already in :attr:`experts`): the tables are
        overwritten in place, so captured graphs see the change."""
        for name, t in zip(ROUTING_BUFFERS, self._routing(placement)):
            getattr(self, name).copy_(t)
        self.placement = placement

    def _routing(self, placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        table, count = placement.replica_table(self.ep_rank)
        return table, count, torch.tensor(placement.local_logical_experts(self.ep_rank))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate, then a replica: x [T, H] -> (physical expert slots [T, K], routing weights [T, K])."""
        if self.replica_table.shape[1] == 1:  # one slot per expert: the fused gate maps ids itself
            routing = self.gate(x, self.replica_table[:, 0])
            return routing.topk_ids, routing.topk_weights
        routing = self.gate(x)
        slots = select_replicas(routing.topk_ids, self.replica_table, self.replica_count, self.ep_rank)
        return slots, routing.topk_weights

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(x) if self.shared_experts is not None else None

    def _dispatch_recv(self, sent: DispatchHandle, topk_ids: torch.Tensor,
                       real_rows: torch.Tensor | None) -> tuple[ExpertInput, DispatchHandle]:
        """The dispatch received, and its token copies counted per logical expert (on the device: no sync)."""
        expert_input, route = self.dispatcher.dispatch_recv(sent)
        if real_rows is not None and self.placement.ep_size == 1:
            # padding rows among the step's (a captured bucket's): on one rank every copy stays here, so the
            # copies counted are the real rows' own (slots are logical experts' through ``slot_experts``);
            # over ranks, the dispatcher leaves them out of the counts where it can (``dispatch_send``)
            copies = real_rows[:, None].expand(topk_ids.shape).reshape(-1).to(self.expert_load.dtype)
            self.expert_load.index_add_(0, self.slot_experts[topk_ids.reshape(-1)], copies)
        else:
            counts = expert_input.num_tokens_per_expert
            index_add_counts(self.expert_load, self.slot_experts, counts)  # one C call on the CPU
        return expert_input, route
