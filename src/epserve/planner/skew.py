"""A measured expert load (``epserve plan --expert-load FILE``): where its token copies land, per placement.

The file is the JSON of ``LLM.expert_load().summary()`` or the server's statistics: an object whose
``per_expert`` is one list per MoE layer of the tokens (token copies) each logical expert received;
its ``layers`` (the layer ids of those rows, where given) set apart the MTP layer's rows (ids from
``num_hidden_layers`` on: an engine decoding with MTP counts its layer too); its other keys (``per_rank``,
``imbalance``, ...) are ignored. ``{"instances": [...]}``
or a bare list of such objects (several engine instances) is summed layer by layer, expert by expert.

A placement puts the logical experts in ``n_routed_experts + num_redundant_experts`` physical slots,
contiguous per EP rank; an expert with ``c`` replicas gives each ``1/c`` of its tokens (the engine's
``position`` replica selection). Without EPLB it is the engine's start-up placement (expert ``e`` in
slot ``e``, the redundant slots holding copies of experts ``0..R-1``); with EPLB,
``epserve.eplb.rebalance_experts(load, slots, n_group, nodes, ep)`` of the file's layers. A layer's
**imbalance** is the busiest rank's share of its copies over the mean rank's (1 = even).

MoE layer ``i`` of ``L`` in the model is priced with the file's layer ``floor(i * F / L)`` of ``F``
main-model layers: the file's own layers when the counts agree, else stretched or sampled by depth. The MTP
layer is priced with the file's MTP row where it has one, else at the mean of its layers. ``torch`` (for
``epserve.eplb`` and the engine's placement) is imported only when a placement is built, numpy only
when a file is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment
from epserve.planner.errors import PlanError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, eq=False)
class PlacedLoad:
    """A load file's layers under one placement: ``shares[layer, rank, slot]``, each physical slot's
    share of its layer's (token, expert) copies (a layer sums to 1)."""

    shares: np.ndarray  # [layers, ep, slots per rank]
    _active: dict[tuple[int, float], np.ndarray] = field(default_factory=dict, repr=False)

    @cached_property
    def imbalance(self) -> np.ndarray:
        """[layers] the busiest rank's copies over the mean rank's."""
        return self.shares.sum(axis=2).max(axis=1) * self.shares.shape[1]

    def busiest_active(self, top_k: int, global_tokens: float) -> np.ndarray:
        """[layers] expected active slots of the rank that activates the most, when ``global_tokens``
        tokens each pick ``top_k`` experts: slot ``s`` is hit by a token with probability
        ``min(1, top_k x share_s)`` (cached per token count: every layer is computed at once)."""
        key = (top_k, float(global_tokens))
        if key not in self._active:
            import numpy as np

            hit = np.minimum(top_k * self.shares, 1.0)
            self._active[key] = (1.0 - (1.0 - hit) ** max(global_tokens, 0.0)).sum(axis=2).max(axis=1)
        return self._active[key]


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer of a placed load, what the step model prices with; ``layer=None``: a layer at the
    mean of the file's layers (the MTP layer's, where the file does not hold its own load)."""

    placed: PlacedLoad
    layer: int | None

    @property
    def imbalance(self) -> float:
        values = self.placed.imbalance
        return float(values.mean() if self.layer is None else values[self.layer])

    def busiest_active(self, top_k: int, global_tokens: float) -> float:
        values = self.placed.busiest_active(top_k, global_tokens)
        return float(values.mean() if self.layer is None else values[self.layer])


@dataclass(frozen=True)
class LoadReport:
    """What a plan's placement makes of the file: each of its layers' imbalance."""

    file: str
    eplb: bool
    layer_imbalance: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        return sum(self.layer_imbalance) / len(self.layer_imbalance)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "layers": len(self.layer_imbalance), "eplb": self.eplb,
                "imbalance": self.imbalance, "max_layer_imbalance": max(self.layer_imbalance)}


@dataclass(frozen=True, eq=False)
class ExpertLoadFile:
    """A load file read and checked: ``per_expert[layer][expert]`` tokens, as floats."""

    path: str
    per_expert: np.ndarray  # [layers, n_routed_experts] float64: the main model's layers, then the MTP layer's
    num_mtp: int = 0  # the last rows that are the MTP layer's
    _placements: dict[tuple[int, ...], PlacedLoad] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return self.per_expert.shape[0]

    @property
    def num_main(self) -> int:
        """The rows of the main model's layers."""
        return self.num_layers - self.num_mtp

    def placed(self, model: ModelConfig, d: Deployment) -> PlacedLoad:
        """The file's layers under ``d``'s placement (``d.eplb``; cached per layout)."""
        if self.per_expert.shape[1] != model.n_routed_experts:
            raise PlanError(f"expert load {self.path}: {self.per_expert.shape[1]} experts per layer, the model "
                            f"has {model.n_routed_experts}")
        key = (d.ep, d.num_redundant_experts, d.eplb, d.num_nodes if d.eplb else 0)
        if key not in self._placements:
            import numpy as np

            phy2log = self._phy2log(model, d)
            replicas = np.stack([np.bincount(row, minlength=self.per_expert.shape[1]) for row in phy2log])
            per_replica = self.per_expert / replicas / self.per_expert.sum(axis=1, keepdims=True)
            shares = np.take_along_axis(per_replica, phy2log, axis=1)
            self._placements[key] = PlacedLoad(shares.reshape(self.num_layers, d.ep, -1))
        return self._placements[key]

    def model_layers(self, model: ModelConfig, d: Deployment) -> tuple[LayerLoad, ...]:
        """One load per MoE layer of the model: layer ``i`` of ``L`` takes the file's ``floor(i F / L)`` of its
        ``F`` main-model layers."""
        placed = self.placed(model, d)
        num_moe = len(model.moe_layer_ids)
        return tuple(LayerLoad(placed, i * self.num_main // num_moe) for i in range(num_moe))

    def mean_layer(self, model: ModelConfig, d: Deployment) -> LayerLoad:
        """The MTP layer's load: the file's MTP row, else the mean of its layers."""
        return LayerLoad(self.placed(model, d), self.num_main if self.num_mtp else None)

    def report(self, model: ModelConfig, d: Deployment) -> LoadReport:
        return LoadReport(self.path, d.eplb, tuple(self.placed(model, d).imbalance.tolist()))

    def _phy2log(self, model: ModelConfig, d: Deployment) -> np.ndarray:
        """[layers, slots] the logical expert in each physical slot."""
        import numpy as np

        if not d.eplb:
            from epserve.moe.placement import ExpertPlacement  # imports torch

            start = ExpertPlacement.build(model.n_routed_experts, d.ep, d.num_redundant_experts).physical_to_logical
            return np.tile(np.asarray(start, dtype=np.int64), (self.num_layers, 1))
        import torch

        from epserve.eplb import rebalance_experts

        slots = model.n_routed_experts + d.num_redundant_experts
        try:
            load = torch.from_numpy(self.per_expert)
            phy2log, _, _ = rebalance_experts(load, slots, model.n_group, d.num_nodes, d.ep)
        except ValueError as e:
            raise PlanError(f"EPLB cannot place the load of {self.path} on EP {d.ep}: {e}") from None
        return phy2log.numpy()


def _instances(raw: Any) -> list[Any]:
    if isinstance(raw, list):
        return raw
    if isinstance(raw, dict) and "instances" in raw and "per_expert" not in raw:
        if not isinstance(raw["instances"], list):
            raise ValueError('"instances" is not a list')
        return raw["instances"]
    return [raw]


def _mtp_rows(instance: Any, model: ModelConfig, where: str) -> int:
    """How many of the instance's last ``per_expert`` rows are the MTP layer's, by its ``layers`` (0 without)."""
    layers = instance.get("layers")
    if layers is None:
        return 0
    if (not isinstance(layers, list) or len(layers) != len(instance["per_expert"])
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers) or layers != sorted(layers)):
        raise ValueError(f'{where}"layers" is not a sorted list of layer ids, one per "per_expert" row')
    mtp = sum(x >= model.num_hidden_layers for x in layers)
    if mtp == len(layers):
        raise ValueError(f"{where}every layer is past the model's {model.num_hidden_layers} (an MTP layer's)")
    return mtp


def _per_expert(instance: Any, index: int) -> np.ndarray:
    import numpy as np

    where = f"instance {index}: " if index >= 0 else ""
    if not isinstance(instance, dict) or "per_expert" not in instance:
        raise ValueError(f'{where}expected an object with "per_expert" (one list of tokens per expert per MoE layer)')
    rows = instance["per_expert"]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise ValueError(f'{where}"per_expert" is not a non-empty list of lists (one per MoE layer)')
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise ValueError(f'{where}"per_expert" layers list different numbers of experts: {sorted(widths)}')
    for i, row in enumerate(rows):
        for e, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}layer {i}, expert {e}: {v!r} is not a non-negative number of tokens")
    return np.asarray(rows, dtype=np.float64)


def load_expert_load(path: str | Path, model: ModelConfig) -> ExpertLoadFile:
    """Read and check an expert-load file for ``model``; ``PlanError`` names the file and the problem."""
    name = str(path)
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"expert load {name}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"expert load {name}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"expert load {name}: not JSON ({e})") from None
    try:
        instances = _instances(raw)
        if not instances:
            raise ValueError("no instances")
        loads = [_per_expert(x, i if len(instances) > 1 else -1) for i, x in enumerate(instances)]
        if len({x.shape for x in loads}) != 1:
            raise ValueError(f"instances differ in shape (layers x experts): {sorted({x.shape for x in loads})}")
        mtp = {_mtp_rows(x, model, f"instance {i}: " if len(instances) > 1 else "") for i, x in enumerate(instances)}
        if len(mtp) != 1:
            raise ValueError(f"instances differ in their MTP layer's rows: {sorted(mtp)}")
    except ValueError as e:
        raise PlanError(f"expert load {name}: {e}") from None
    total, num_mtp = sum(loads[1:], loads[0]), mtp.pop()
    if num_mtp and total[-num_mtp:].sum() <= 0:  # an MTP layer that never drafted: priced as without one
        total, num_mtp = total[:-num_mtp], 0
    if total.shape[1] != model.n_routed_experts:
        raise PlanError(f"expert load {name}: {total.shape[1]} experts per layer, the model has "
                        f"{model.n_routed_experts} routed experts")
    idle = [i for i, row in enumerate(total) if row.sum() <= 0]
    if len(idle) == len(total):
        raise PlanError(f"expert load {name}: every count is zero (no tokens routed)")
    if idle:
        raise PlanError(f"expert load {name}: MoE layer {idle[0]} of the file has no tokens")
    return ExpertLoadFile(name, total, num_mtp)
