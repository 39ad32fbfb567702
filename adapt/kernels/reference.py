"""float64 references of adapt's DSA kernels, computed from the dequantized operands on the CPU.

Shared by stage 3 (``adapt.stages.kernels``) and the kernel tests: a kernel is judged against these,
never only against its own torch twin. Tensors only (cache pools as [pages, 64, ...] with the slot
addressing of ``adapt.kernels.formats``).
"""

from __future__ import annotations

import math

import torch

from adapt.kernels.formats import slots_of


def index_scores_reference(q8: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                           index_scale: torch.Tensor, block_table: torch.Tensor, token_seq: torch.Tensor,
                           limits: torch.Tensor, cols: int) -> torch.Tensor:
    """DSA index scores, float64 [N, cols]: kscale[s] * sum_h w[t, h] * relu(q8[t, h] . k8[s]) for
    key positions s < limits[t], -inf elsewhere.

    q8: e4m3 [N, H, D]; weights: fp32 [N, H] (query scales folded in); index_k: e4m3 [pages, 64, D];
    index_scale: fp32 [pages, 64]; block_table: int [B, P]; token_seq: int [N]; limits: int [N].
    """
    n, dim = q8.shape[0], q8.shape[-1]
    ref = torch.full((n, cols), -math.inf, dtype=torch.float64)
    tables = block_table.long().cpu()
    keys = index_k.reshape(-1, dim).double().cpu()
    kscale = index_scale.reshape(-1).double().cpu()
    for row in range(n):
        slots = slots_of(tables[int(token_seq[row])], torch.arange(int(limits[row])))
        logits = q8[row].double().cpu() @ keys[slots].T
        head_sum = (logits.clamp_min(0) * weights[row].double().cpu()[:, None]).sum(0)
        ref[row, : len(slots)] = head_sum * kscale[slots]
    return ref


def sparse_mla_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_rows: torch.Tensor,
                         block_table: torch.Tensor, token_seq: torch.Tensor, indices: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Sparse MLA over each query's selected positions, float64 [N, H, rank]:
    softmax(q . [nope, rope] * scale) @ nope.

    q_nope: [N, H, rank] (the query in latent space); q_rope: [N, H, rope]; kv_rows: dequantized
    cache rows [pages * 64, rank + rope] in slot order; indices: int [N, k] positions (-1 none).
    Rows with no selected position stay 0.
    """
    rank = q_nope.shape[-1]
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    tables = block_table.long().cpu()
    rows_all = kv_rows.double().cpu()
    for row in range(q_nope.shape[0]):
        idx = indices[row].long().cpu()
        idx = idx[idx >= 0]
        if idx.numel() == 0:
            continue
        kv = rows_all[slots_of(tables[int(token_seq[row])], idx)]
        q = torch.cat([q_nope[row], q_rope[row]], -1).double().cpu()
        out[row] = torch.softmax(q @ kv.T * scale, -1) @ kv[:, :rank]
    return out
