"""Expert-parallel load balancing (EPLB): where each MoE layer's experts live across the EP ranks.

From a load snapshot per logical expert, heavy experts get redundant replicas (``num_replicas``
physical slots in all, ``num_replicas // num_gpus`` per GPU) and the replicas are packed so GPUs carry
even loads; with ``num_nodes`` dividing the model's expert groups, whole groups stay on one node.

Maps, per MoE layer ``l`` (int64, as in DeepSeek's published EPLB):

- ``phy2log[l, p]``: the logical expert in physical slot ``p``; slot ``p`` is on GPU
  ``p // (num_replicas // num_gpus)``.
- ``log2phy[l, e, i]``: the ``i``-th physical slot of logical expert ``e``, ascending, padded with -1 to
  the most replicas any expert has.
- ``logcnt[l, e]``: the number of replicas of ``e``; each serves ``1 / logcnt`` of its load.
"""

from epserve.eplb.policy import gpu_loads, greedy_rebalance_experts, imbalance, rebalance_experts

__all__ = ["greedy_rebalance_experts", "gpu_loads", "imbalance", "rebalance_experts"]
