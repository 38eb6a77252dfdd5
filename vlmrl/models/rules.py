"""How one Megatron parameter maps to HF checkpoint tensors (standard library only).

A `Rule` names the HF tensor(s) a Megatron parameter is made of and the kind of cut that
relates them (`vlmrl.models.adapters` implements each kind, both directions):

- copy: the same tensor (norms, the router, every vision parameter), replicated over TP;
- rows / cols: cut along dim 0 / dim 1 over TP (column- / row-parallel linears,
  vocab-parallel embedding and output layer);
- qkv: q/k/v projections fused per query group ([q heads of group g; k_g; v_g]), cut by groups;
- qkv_gated: the same with the output gate: HF's q_proj holds [query_h; gate_h] per head,
  Megatron's rows per group are [queries; gates; k_g; v_g];
- gate_up: [gate_r; up_r] on TP rank r (SwiGLU fc1);
- gdn_qkv: Gated DeltaNet rows ([all q; all k; all v] in HF) regrouped per key head
  ([q_h; k_h; v of the value heads of h]), cut by key heads (in_proj_qkv and conv1d);
- experts_gate_up / experts_down: per-expert HF tensors (gate_proj, up_proj / down_proj of
  experts e0, e0+1, ...) stacked into HF's fused [E, 2I, H] / [E, H, I]; cut over expert
  parallelism, not TP (`expert=True`).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("copy", "rows", "cols", "qkv", "qkv_gated", "gate_up", "gdn_qkv", "experts_gate_up", "experts_down")


@dataclass(frozen=True)
class Rule:
    kind: str
    hf: tuple[str, ...]
    export: bool = True  # False: a copy of a tensor exported elsewhere (tied output layer)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown rule kind {self.kind!r}")

    @property
    def expert(self) -> bool:
        return self.kind.startswith("experts_")
