"""EPLB placement: replicate heavy logical experts and pack the replicas onto GPUs.

Same entry point and map layout as DeepSeek's published EPLB. ``greedy_rebalance_experts`` is its greedy
policy; ``rebalance_experts`` refines each packing by swaps, also tries holding a few redundant replicas
back from the heaviest experts, and keeps per layer the placement whose busiest GPU is least loaded,
the greedy one included.
"""

from __future__ import annotations

import torch

Maps = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# Relative margin a swap must gain by: float64 round-off never counts as an improvement.
_TOL = 1e-9
# Refined candidates hold back 0.._MAX_HOLD_BACK redundant replicas per node (see ``_replicate``).
_MAX_HOLD_BACK = 4


def _validate(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
              num_gpus: int) -> torch.Tensor:
    """The load as a float64 CPU tensor, after checking every argument."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D tensor [layers, num_logical], got {shape}")
    num_layers, num_logical = weight.shape
    if num_layers == 0 or num_logical == 0:
        raise ValueError(f"weight has no layers or no experts: shape {tuple(weight.shape)}")
    if weight.is_complex():
        raise ValueError(f"weight must be real, got dtype {weight.dtype}")
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas ({num_replicas}) is less than the number of logical experts ({num_logical})")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) is not divisible by num_gpus ({num_gpus})")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) is not divisible by num_nodes ({num_nodes})")
    if num_groups % num_nodes == 0 and num_logical % num_groups:
        raise ValueError(f"num_groups ({num_groups}) does not divide the {num_logical} logical experts")
    load = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all():
        raise ValueError("weight has NaN or infinite loads")
    if (load < 0).any():
        raise ValueError("weight has negative loads")
    return load


def _pack(weight: torch.Tensor, num_packs: int) -> torch.Tensor:
    """Greedy balanced packing of each row's ``n`` items into ``num_packs`` packs of ``n // num_packs``:
    heaviest item first, each into the lightest pack not yet full (the first such pack on ties).

    weight: [rows, n]. Returns the item ids of each pack in filling order, [rows, num_packs, n // num_packs].
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return torch.arange(n).expand(rows, n).reshape(rows, n, 1).clone()
    order = weight.argsort(dim=1, descending=True, stable=True)
    pack_load = torch.zeros(rows, num_packs, dtype=weight.dtype)
    pack_count = torch.zeros(rows, num_packs, dtype=torch.int64)
    layout = torch.empty(rows, num_packs, per_pack, dtype=torch.int64)
    row = torch.arange(rows)
    for i in range(n):
        item = order[:, i]
        pack = pack_load.masked_fill(pack_count >= per_pack, float("inf")).argmin(dim=1)
        layout[row, pack, pack_count[row, pack]] = item
        pack_load[row, pack] += weight[row, item]
        pack_count[row, pack] += 1
    return layout


def _refine(weight: torch.Tensor, layout: torch.Tensor, max_iters: int) -> torch.Tensor:
    """Local search on a packing: in every row at once, swap one item of the busiest pack with one item
    of another pack, choosing the swap whose busier pack of the two ends lightest, as long as that pack
    ends lighter than the busiest pack was. Each swap lowers the row's sorted pack loads
    lexicographically, so the search stops; ``max_iters`` bounds it.

    weight: [rows, n]; layout: [rows, packs, per_pack] item ids (from ``_pack``). Returns a new layout.
    """
    rows, num_packs, per_pack = layout.shape
    layout = layout.clone()
    if num_packs < 2:
        return layout
    item_load = weight.gather(1, layout.view(rows, -1)).view(rows, num_packs, per_pack)
    active = torch.arange(rows)  # a row without an improving swap never changes again: drop it
    for _ in range(max_iters):
        loads = item_load[active]
        row = torch.arange(len(active))
        pack_load = loads.sum(dim=-1)
        hot = pack_load.argmax(dim=1)
        hot_load = pack_load[row, hot]
        # delta[r, a, j]: load leaving the busiest pack when its item a trades places with item j (any pack).
        delta = loads[row, hot][:, :, None] - loads.view(len(active), 1, -1)
        # Trading within the busiest pack gives max(L - d, L + d) >= L: never taken.
        other_load = pack_load.repeat_interleave(per_pack, dim=1)[:, None, :]
        pair_max = torch.maximum(hot_load[:, None, None] - delta, other_load + delta)
        best, best_idx = pair_max.view(len(active), -1).min(dim=1)
        improve = best < hot_load * (1 - _TOL)
        active, idx, h = active[improve], best_idx[improve], hot[improve]
        if not len(active):
            break
        a, j = idx // (num_packs * per_pack), idx % (num_packs * per_pack)
        g, b = j // per_pack, j % per_pack
        layout[active, h, a], layout[active, g, b] = layout[active, g, b], layout[active, h, a]
        item_load[active, h, a], item_load[active, g, b] = item_load[active, g, b], item_load[active, h, a]
    return layout


def _replicate(weight: torch.Tensor, num_phy: int, hold_back: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give the ``n`` items of each row ``num_phy`` replicas: one each, then each further replica to the
    item with the greatest load per replica (the first such item on ties). The last ``hold_back[row]``
    replicas go instead to the heaviest items still without a second replica, while there are any: fewer
    big replicas than the pigeonhole forces two onto one GPU, and smaller items to fill GPUs with.

    weight: [rows, n]; hold_back: [rows]. Returns phy2item [rows, num_phy] (slot i < n holds item i) and
    count [rows, n].
    """
    rows, n = weight.shape
    phy2item = torch.arange(num_phy).repeat(rows, 1)
    count = torch.ones(rows, n, dtype=torch.int64)
    row = torch.arange(rows)
    single_first = weight + weight.amax(dim=1, keepdim=True) + 1  # outranks any load per replica
    for slot in range(n, num_phy):
        held = (slot >= num_phy - hold_back)[:, None] & (count == 1)
        item = torch.where(held, single_first, weight / count).argmax(dim=1)
        phy2item[:, slot] = item
        count[row, item] += 1
    return phy2item, count


def _place(load: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
           refine: bool, hold_back: torch.Tensor) -> torch.Tensor:
    """phy2log [layers, num_replicas] of the published policy (hierarchical when ``num_nodes`` divides
    ``num_groups``, else one node holding one group), each packing refined by ``_refine`` if ``refine``;
    ``hold_back`` [layers] as for ``_replicate``, per node."""
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    num_layers, num_logical = load.shape
    group_size = num_logical // num_groups
    log_per_node = num_logical // num_nodes
    phy_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # 1. Whole groups onto nodes; node n's local experts are its groups' experts, in packing order.
    group_load = load.view(num_layers, num_groups, group_size).sum(dim=-1)
    node_groups = _pack(group_load, num_nodes)
    if refine:
        node_groups = _refine(group_load, node_groups, max_iters=4 * num_groups)
    local2log = (node_groups.view(num_layers, -1, 1) * group_size + torch.arange(group_size)).view(-1, log_per_node)
    local_load = load.gather(1, local2log.view(num_layers, -1)).view(-1, log_per_node)

    # 2. Replicas within each node ([layers * nodes, ...] rows from here on).
    phy2local, local_count = _replicate(local_load, phy_per_node, hold_back.repeat_interleave(num_nodes))

    # 3. Replicas onto the node's GPUs; slot order is GPU by GPU.
    phy_load = (local_load / local_count).gather(1, phy2local)
    gpu_phys = _pack(phy_load, gpus_per_node)
    if refine:
        gpu_phys = _refine(phy_load, gpu_phys, max_iters=4 * phy_per_node)
    slot2local = phy2local.gather(1, gpu_phys.view(phy2local.shape[0], -1))
    return local2log.gather(1, slot2local).view(num_layers, num_replicas)


def _logcnt(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Replicas per logical expert, [rows, num_logical] int64."""
    logcnt = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    return logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def _maps(phy2log: torch.Tensor, num_logical: int) -> Maps:
    """(phy2log, log2phy, logcnt); each expert's slots listed in ascending order, padded with -1."""
    num_layers, num_replicas = phy2log.shape
    logcnt = _logcnt(phy2log, num_logical)
    max_count = int(logcnt.max())
    slots = phy2log.argsort(dim=1, stable=True)
    owner = phy2log.gather(1, slots)
    replica = torch.arange(num_replicas) - (logcnt.cumsum(dim=1) - logcnt).gather(1, owner)
    log2phy = torch.full((num_layers, num_logical * max_count), -1, dtype=torch.int64)
    log2phy.scatter_(1, owner * max_count + replica, slots)
    return phy2log, log2phy.view(num_layers, num_logical, max_count), logcnt


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load per GPU, [layers, num_gpus] float64: each replica carries its logical expert's load divided by
    the expert's replica count; slot p is on GPU ``p // (num_replicas // num_gpus)``."""
    num_layers, num_replicas = phy2log.shape
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) is not divisible by num_gpus ({num_gpus})")
    per_replica = weight.detach().to("cpu", torch.float64) / logcnt.cpu()
    return per_replica.gather(1, phy2log.cpu()).view(num_layers, num_gpus, -1).sum(dim=-1)


def imbalance(loads: torch.Tensor) -> torch.Tensor:
    """Busiest GPU load over mean GPU load per layer of ``loads`` [layers, num_gpus] (as from
    ``gpu_loads``), [layers]; 1.0 for a layer with no load."""
    mean = loads.mean(dim=-1)
    return torch.where(mean > 0, loads.amax(dim=-1) / mean, torch.ones_like(mean))


def greedy_rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                             num_gpus: int) -> Maps:
    """The published greedy EPLB policy; arguments and results as for ``rebalance_experts``."""
    load = _validate(weight, num_replicas, num_groups, num_nodes, num_gpus)
    no_hold_back = torch.zeros(load.shape[0], dtype=torch.int64)
    return _maps(_place(load, num_replicas, num_groups, num_nodes, num_gpus, False, no_hold_back), load.shape[1])


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Maps:
    """Expert placement for one load snapshot.

    weight: [layers, num_logical] load per logical expert (any real dtype, non-negative).
    num_replicas: physical expert slots (logical + redundant), a multiple of ``num_gpus``.
    num_groups: expert groups (the model's ``n_group``); when ``num_nodes`` divides it, whole groups are
    packed onto nodes and every replica of an expert stays on its group's node, else one global pool.
    num_nodes: nodes; ``num_gpus`` (EP ranks) must be a multiple of it.

    Returns CPU int64 tensors: phy2log [layers, num_replicas] (slot p on GPU ``p // (num_replicas //
    num_gpus)``), log2phy [layers, num_logical, max replicas] (slots of each expert, ascending, -1
    padded) and logcnt [layers, num_logical]. Raises ValueError on inconsistent arguments or invalid loads.

    Candidates per layer: the greedy placement, and refined ones (group and replica packings improved
    by swaps) holding back 0 to ``_MAX_HOLD_BACK`` redundant replicas per node; the one with the least
    busy busiest GPU wins, the greedy one on ties, so no layer is worse off than under
    ``greedy_rebalance_experts``.
    """
    load = _validate(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_layers, num_logical = load.shape
    pools = num_nodes if num_groups % num_nodes == 0 else 1
    variants = min(_MAX_HOLD_BACK, (num_replicas - num_logical) // pools) + 1
    greedy = _place(load, num_replicas, num_groups, num_nodes, num_gpus, False,
                    torch.zeros(num_layers, dtype=torch.int64))
    refined = _place(load.repeat(variants, 1), num_replicas, num_groups, num_nodes, num_gpus, True,
                     torch.arange(variants).repeat_interleave(num_layers))
    candidates = torch.cat([greedy, refined])
    loads = gpu_loads(load.repeat(variants + 1, 1), candidates, _logcnt(candidates, num_logical), num_gpus)
    # argmin takes the first of equal loads: the greedy placement unless a refined one is strictly better.
    best = loads.amax(dim=1).view(variants + 1, num_layers).argmin(dim=0)
    return _maps(candidates.view(variants + 1, num_layers, -1)[best, torch.arange(num_layers)], num_logical)
