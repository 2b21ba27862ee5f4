"""Triton kernels of the paged KV cache (CUDA only; importing this module needs Triton).

- `store_kv`: each row's key and value into its slot; a row whose slot is < 0 (graph padding) stores nothing.
- `paged_decode`: one query row per sequence, grouped-query heads, online softmax in float32, keys and values
  read through the block table. One program per (sequence, kv head) walks the context from position 0 in
  fixed steps of BLOCK_N tokens: the order of every reduction depends on that sequence's context length alone,
  so the result is the same whatever else the batch holds (attention.py invariant 1). The rep query heads
  that share a kv head are one tile (padded to 16 rows for `tl.dot`): each key block is read once per kv head.
- `paged_prefill`: causal attention of every prefill chunk of a step in one launch: one program per (tile of
  one sequence's rows, kv head), the tile's rows x the kv head's query heads one `tl.dot` operand, walking the
  context from position 0 in fixed steps of BLOCK_N like the decode kernel (batch-invariant the same way).
- `rms_norm`, `silu_mul`: RMSNorm and SwiGLU's silu(gate) * up, one kernel each instead of ~8 and 3 small torch
  kernels (a decode step of the 8b shape ran ~40 kernels a layer). One program a row (or a row's block): a row's
  result depends on that row alone, so both are batch-invariant without tiles.
- `add_rms_norm_`: a residual add and the RMSNorm that follows it, one kernel instead of two: the sum rounded to
  the dtype and written back in place (the residual stream), its norm out, both as torch computes them.
- `rope_`: rotary embedding of the fused projection's q and k heads, in place, one kernel instead of torch's five
  (the half rotation's negation and concatenation, two products, a sum: ~0.43 ms of a 6.1 ms decode step at 64
  rows of the 8b shape, H200). Each product and the sum are rounded to the tensor's dtype as torch rounds them,
  and no multiply-add is fused, so the values are `engines/reference/model.py apply_rope`'s bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_stride, v_stride, kc_ptr, vc_ptr, slot_ptr, D: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    k = tl.load(k_ptr + row * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + row * v_stride + offs, mask=mask)
    tl.store(kc_ptr + slot * D + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * D + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(layer_kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    T = k.shape[0]
    if T == 0:
        return
    kvh, hd = layer_kv.shape[-2:]
    d = kvh * hd
    k2, v2 = k.reshape(T, d), v.reshape(T, d)
    if k2.stride(1) != 1 or v2.stride(1) != 1:
        k2, v2 = k2.contiguous(), v2.contiguous()
    _store_kv_kernel[(T,)](k2, v2, k2.stride(0), v2.stride(0), layer_kv[0], layer_kv[1], slot_mapping, D=d,
                           BLOCK=triton.next_power_of_2(d))


# The block tables' row stride is the step's widest table in an eager step: left unspecialized, or Triton would
# compile another variant (~1 s) the first time it is or is not a multiple of 16 (H200, 64 streams: a 1.2 s stall).
@triton.jit(do_not_specialize=["bt_stride"])
def _paged_decode_kernel(q_ptr, q_stride_t, q_stride_h, o_ptr, o_stride_t, o_stride_h, kc_ptr, vc_ptr,
                         slot_stride, bt_ptr, bt_stride, lens_ptr, scale, REP: tl.constexpr,
                         REP_PAD: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    seq = tl.program_id(0)
    g = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    heads = g * REP + tl.arange(0, REP_PAD)
    hmask = tl.arange(0, REP_PAD) < REP
    dims = tl.arange(0, HD)
    q = tl.load(q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=hmask[:, None],
                other=0.0)
    m = tl.full((REP_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((REP_PAD,), tl.float32)
    acc = tl.zeros((REP_PAD, HD), tl.float32)
    for start in range(0, ctx, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < ctx
        blk = tl.load(bt_ptr + seq * bt_stride + t // BS, mask=tmask, other=0)
        slot = blk * BS + t % BS
        offs = slot[:, None] * slot_stride + g * HD + dims[None, :]
        k = tl.load(kc_ptr + offs, mask=tmask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=tmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # ctx 0 (a padding row): 0
    tl.store(o_ptr + seq * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


def paged_decode(q: torch.Tensor, layer_kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 block_n: int = 64, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, hd] (one row per sequence) -> [B, H, hd] (`out`, given: written in place)."""
    B, heads, hd = q.shape
    kvh = layer_kv.shape[-2]
    rep = heads // kvh
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_decode_kernel[(B, kvh)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), layer_kv[0], layer_kv[1], kvh * hd,
        block_tables, block_tables.stride(0), context_lens, 1.0 / hd ** 0.5, REP=rep,
        REP_PAD=max(16, triton.next_power_of_2(rep)), HD=hd, BS=layer_kv.shape[2], BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32)
    return out


@triton.jit(do_not_specialize=["bt_stride"])
def _paged_prefill_kernel(q_ptr, q_stride_t, q_stride_h, o_ptr, o_stride_t, o_stride_h, kc_ptr, vc_ptr,
                          slot_stride, bt_ptr, bt_stride, tiles_ptr, scale, REP: tl.constexpr,
                          REP_PAD: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 4)  # the sequence's row in the block tables
    row0 = tl.load(tiles_ptr + tile * 4 + 1)  # flat row of the tile's first query
    nrows = tl.load(tiles_ptr + tile * 4 + 2)  # its rows (<= BLOCK_M; 0: a padding tile, which stores nothing)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)  # the position of its first row
    m_idx = tl.arange(0, BLOCK_M * REP_PAD)  # the tile's query rows x the kv head's query heads, row-major
    r = m_idx // REP_PAD
    h = m_idx % REP_PAD
    valid = (r < nrows) & (h < REP)
    heads = g * REP + h
    dims = tl.arange(0, HD)
    q = tl.load(q_ptr + (row0 + r)[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
                mask=valid[:, None], other=0.0)
    q_pos = pos0 + tl.minimum(r, tl.maximum(nrows - 1, 0))  # a padding row sees what the tile's last row sees
    kv_end = pos0 + nrows
    m = tl.full((BLOCK_M * REP_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M * REP_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_M * REP_PAD, HD), tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        tmask = t < kv_end
        blk = tl.load(bt_ptr + seq * bt_stride + t // BS, mask=tmask, other=0)
        slot = blk * BS + t % BS
        offs = slot[:, None] * slot_stride + g * HD + dims[None, :]
        k = tl.load(kc_ptr + offs, mask=tmask[:, None], other=0.0)
        v = tl.load(vc_ptr + offs, mask=tmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :] & (t[None, :] <= q_pos[:, None]), s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(o_ptr + (row0 + r)[:, None] * o_stride_t + heads[:, None] * o_stride_h + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


def paged_prefill(q: torch.Tensor, out: torch.Tensor, layer_kv: torch.Tensor, block_tables: torch.Tensor,
                  tiles: torch.Tensor, tile_rows: int, block_n: int = 64) -> None:
    """Causal attention of prefill chunks, every chunk of the step in one launch: q [T, H, hd] (flat rows), out
    [T, H, hd] written at the tiles' rows only, tiles [n, 4] int64 on q's device (attention.prefill_tiles: each
    one sequence's row, first flat row, rows <= tile_rows, first position)."""
    T, heads, hd = q.shape
    kvh = layer_kv.shape[-2]
    rep = heads // kvh
    if tiles.shape[0] == 0:
        return
    if q.stride(2) != 1:
        q = q.contiguous()
    _paged_prefill_kernel[(tiles.shape[0], kvh)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), layer_kv[0], layer_kv[1], kvh * hd,
        block_tables, block_tables.stride(0), tiles, 1.0 / hd ** 0.5, REP=rep,
        REP_PAD=triton.next_power_of_2(rep), HD=hd, BS=layer_kv.shape[2], BLOCK_M=tile_rows, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32)


@triton.jit
def _scaled_norm(x, w_ptr, offs, mask, N, eps, dt: tl.constexpr):
    """One row's RMSNorm (x float32, the row's values in `dt`) times the weight, as float32: the reference's values
    (engines/reference/model.py `rms_norm`: normalized, rounded to the input's dtype, then scaled)."""
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return w * y.to(dt).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, w_ptr, o_ptr, o_stride, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_stride + offs, _scaled_norm(x, w_ptr, offs, mask, N, eps, dt).to(dt), mask=mask)


@triton.jit
def _add_rms_norm_kernel(h_ptr, h_stride, d_ptr, d_stride, w_ptr, o_ptr, o_stride, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = h_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * d_stride + offs, mask=mask, other=0.0).to(tl.float32)
    x = (h + d).to(dt)  # torch's `h + d`, rounded to the dtype
    tl.store(h_ptr + row * h_stride + offs, x, mask=mask)
    y = _scaled_norm(x.to(tl.float32), w_ptr, offs, mask, N, eps, dt)
    tl.store(o_ptr + row * o_stride + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h += delta` (rounded to h's dtype, in place) and `rms_norm(h)` of the sum, in one kernel: the values of
    `h = h + delta; rms_norm(h, weight, eps)`, one program a row (batch-invariant as `rms_norm`)."""
    T, N = h.shape
    out = torch.empty_like(h)
    if T == 0:
        return out
    assert h.stride(1) == 1 and delta.shape == h.shape and delta.dtype == h.dtype
    if delta.stride(1) != 1:
        delta = delta.contiguous()
    _add_rms_norm_kernel[(T,)](h, h.stride(0), delta, delta.stride(0), weight, out, out.stride(0), N, eps,
                               BLOCK=triton.next_power_of_2(N), num_warps=8 if N >= 2048 else 4)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """engines/reference/model.py's `rms_norm` in one kernel (one program a row: a row's result depends on that
    row alone, so it is batch-invariant as it stands)."""
    T, N = x.shape
    out = torch.empty_like(x)
    if T == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    _rms_norm_kernel[(T,)](x, x.stride(0), weight, out, out.stride(0), N, eps, BLOCK=triton.next_power_of_2(N),
                           num_warps=8 if N >= 2048 else 4)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, x_stride, o_ptr, o_stride, F, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    a = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * x_stride + F + offs, mask=mask, other=0.0).to(tl.float32)
    s = (a / (1.0 + tl.exp(-a))).to(o_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds to the dtype first
    tl.store(o_ptr + row * o_stride + offs, (s * b).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` of x = [gate | up] ([T, 2F], the fused w1/w3 projection's output) -> [T, F],
    in one kernel; elementwise, so batch-invariant."""
    T, two_f = x.shape
    f = two_f // 2
    out = torch.empty((T, f), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block = 1024
    _silu_mul_kernel[(T, triton.cdiv(f, block))](x, x.stride(0), out, out.stride(0), f, BLOCK=block)
    return out


@triton.jit
def _rope_kernel(x_ptr, x_stride, cos_ptr, sin_ptr, cs_stride, HALF: tl.constexpr):
    t = tl.program_id(0)
    base = x_ptr + t * x_stride + tl.program_id(1) * (2 * HALF)
    offs = tl.arange(0, HALF)
    dt = x_ptr.dtype.element_ty
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    c1 = tl.load(cos_ptr + t * cs_stride + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + t * cs_stride + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + t * cs_stride + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + t * cs_stride + HALF + offs).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: each product rounded, then the sum
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(base + offs, o1.to(dt))
    tl.store(base + HALF + offs, o2.to(dt))


def rope_fits(head_dim: int) -> bool:
    """Whether `rope_` takes heads of this size (a power-of-two half)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding of the first `heads` heads of each row of `x` ([T, >= heads * head_dim], the heads back to
    back, unit stride within a row), in place; cos and sin [T, head_dim] in x's dtype (the model's tables, gathered
    at the rows' positions)."""
    T = x.shape[0]
    if T == 0:
        return
    assert x.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(0) == cos.stride(0) and rope_fits(head_dim)
    _rope_kernel[(T, heads)](x, x.stride(0), cos, sin, cos.stride(0), HALF=head_dim // 2, enable_fp_fusion=False)
