"""Triton kernels of the causal GDN commit (reference: ``gdn/naive.py: gdn_commit``).

Pipeline for T committed rows (B batch, Hk key heads, Hv value heads, C conv channels):

1. ``_conv_silu_kernel`` [grid: C tiles x T tiles x B]: depthwise causal conv over
   ``[ring ; mixed]`` + SiLU -> ``act`` [B, T, C] (mixed's dtype); the program holding the
   first T tile also writes the new ring (the last K-1 pre-conv rows).
2. T == 1 (AR decode): ``_recurrent_kernel`` [grid: dv tiles x B*Hv]: L2-normalises q, k
   in registers and applies the gated delta rule token by token on an fp32 state tile.
3. T > 1: the chunked (UT-transform) rule, split like flash-linear-attention's
   chunk_gated_delta_rule into the part that does not depend on the state (parallel over
   chunks) and the sequential state recurrence:
   - ``_chunk_prep_kernel`` [grid: chunks x B*Hv]: per chunk of BT rows, cumulative log
     decay G, A = strict_tril(beta k k^T * exp(G_i - G_j)), (I + A)^-1 by forward
     substitution, u = (I + A)^-1 (beta v), w = (I + A)^-1 (beta k exp(G)) -> fp32 scratch.
   - ``_chunk_fwd_kernel`` [grid: dv tiles x B*Hv]: loops over chunks keeping the state
     tile S [dk, BV] in fp32: v_new = u - w S; o = (q exp(G)) S + (tril(q k^T) * decay) v_new;
     S = exp(G_last) S + (k exp(G_last - G))^T v_new. The output is computed in the same
     pass, so no per-chunk states are materialised.
   q and k are L2-normalised where they are loaded (no normalised copies in memory); key
   heads are shared by REP = Hv // Hk consecutive value heads by index arithmetic.

``gdn_commit_varlen``: rows' segments packed on one token axis (``varlen.py``), the same kernels
with ``VARLEN``: a program's batch row is a segment (its ring's and state's row), whose tokens it
reads from the segment's offset of the packed axis; chunks never cross a segment's edge.

All decay/softmax arithmetic is fp32. Dots take ``input_precision="ieee"`` for fp32 inputs
(bit-for-bit comparable to the reference) and tf32 otherwise (error below bf16/fp16 input
rounding).
"""
import torch
import triton
import triton.language as tl

from ..varlen import check_segments
from .common import check_gdn_shapes, conv_tile, dot_precision, l2norm_rows, last_dim_contiguous, segment
from .naive import check_out

# rows per chunk of the chunked rule (a block of Clover is 32): at dk = dv = 128 the chunk kernels
# hold q, k, w of a chunk in registers, and sm_90's 255 per thread fit 32 rows (16 with fp32 tiles)
# without spilling (tests/kernels/test_compile_sm90.py)
CHUNK_SIZE = 32
CHUNK_SIZE_FP32 = 16
RECURRENT_MAX_T = 1  # T at or below which the token-by-token kernel is used


@triton.jit
def _conv_silu_kernel(mixed_ptr, ring_ptr, cw_ptr, act_ptr, new_ring_ptr, cu_ptr, T, C,
                      s_mb, s_mt, s_rb, s_rc, s_ri, s_ab, s_at, s_nb, s_nc, s_ni,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, VARLEN: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)  # varlen: the segment (its ring's row); mixed's and act's batch strides 0
    if VARLEN:
        bos, T = segment(cu_ptr, b)
        mixed_ptr += bos * s_mt
        act_ptr += bos * s_at
    c = pid_c * BC + tl.arange(0, BC)
    cm = c < C
    t = pid_t * BT + tl.arange(0, BT)
    tm = t < T
    y = conv_tile(mixed_ptr, ring_ptr, cw_ptr, cw_ptr, b, t, tm, c, cm, T,
                   s_mb, s_mt, s_rb, s_rc, s_ri, K, False)
    tl.store(act_ptr + b * s_ab + t[:, None] * s_at + c[None, :], y.to(act_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])
    if pid_t == 0:
        # new ring column i = X[T + i] (X indexed from -(K-1)): a mixed row or an old ring column
        dt = mixed_ptr.dtype.element_ty
        for i in tl.static_range(K - 1):
            s = c * 0 + (T - (K - 1) + i)  # per-channel copy of the source row
            xm = tl.load(mixed_ptr + b * s_mb + s * s_mt + c, mask=cm & (s >= 0), other=0.0)
            xr = tl.load(ring_ptr + b * s_rb + c * s_rc + (s + (K - 1)) * s_ri, mask=cm & (s < 0), other=0.0)
            x = tl.where(s >= 0, xm.to(dt), xr.to(dt))
            tl.store(new_ring_ptr + b * s_nb + c * s_nc + i * s_ni, x.to(new_ring_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _recurrent_kernel(act_ptr, g_ptr, beta_ptr, s0_ptr, o_ptr, sT_ptr, cu_ptr, T,
                      s_ab, s_at, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_ob, s_ot, s_oh,
                      HV, REP, KEY_DIM, scale,
                      DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      VARLEN: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HV  # varlen: the segment (its state's row); the token axis' batch strides 0
    h = pid_bh % HV
    if VARLEN:
        bos, T = segment(cu_ptr, b)
        act_ptr += bos * s_at
        g_ptr += bos * s_gt
        beta_ptr += bos * s_bt
        o_ptr += bos * s_ot
    hk = h // REP
    kr = tl.arange(0, BK)
    km = kr < DK
    vr = pid_v * BV + tl.arange(0, BV)
    vm = vr < DV
    smask = km[:, None] & vm[None, :]
    s_off = pid_bh * DK * DV + kr[:, None] * DV + vr[None, :]
    S = tl.load(s0_ptr + s_off, mask=smask, other=0.0)
    for t in range(T):
        row = act_ptr + b * s_ab + t * s_at
        q = tl.load(row + hk * DK + kr, mask=km, other=0.0).to(tl.float32)
        k = tl.load(row + KEY_DIM + hk * DK + kr, mask=km, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * KEY_DIM + h * DV + vr, mask=vm, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = tl.load(g_ptr + b * s_gb + t * s_gt + h * s_gh).to(tl.float32)
        beta = tl.load(beta_ptr + b * s_bb + t * s_bt + h * s_bh).to(tl.float32)
        S = S * tl.exp(g)
        pred = tl.sum(k[:, None] * S, axis=0)  # [BV]
        delta = (v - pred) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * S, axis=0)
        tl.store(o_ptr + b * s_ob + t * s_ot + h * s_oh + vr, o.to(o_ptr.dtype.element_ty), mask=vm)
    tl.store(sT_ptr + s_off, S, mask=smask)


@triton.jit
def _chunk_prep_kernel(act_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, G_ptr, cu_ptr, T, T_ALL,
                       s_ab, s_at, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
                       HV, REP, KEY_DIM,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr,
                       BT: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HV
    h = pid_bh % HV
    if VARLEN:  # chunks of the segment past its length store nothing (every row masked)
        bos, T = segment(cu_ptr, b)
        act_ptr += bos * s_at
        g_ptr += bos * s_gt
        beta_ptr += bos * s_bt
        scratch = h * T_ALL + bos  # the scratch [Hv, T_ALL, ...] over the packed token axis
    else:
        scratch = pid_bh * T  # [B * Hv, T, ...]
    hk = h // REP
    r = tl.arange(0, BT)
    t = pid_n * BT + r
    tm = t < T
    kr = tl.arange(0, BK)
    km = kr < DK
    vr = tl.arange(0, BDV)
    vm = vr < DV
    rows = act_ptr + b * s_ab + t[:, None] * s_at
    k = tl.load(rows + KEY_DIM + hk * DK + kr[None, :], mask=tm[:, None] & km[None, :], other=0.0).to(tl.float32)
    k = l2norm_rows(k)
    v = tl.load(rows + 2 * KEY_DIM + h * DV + vr[None, :], mask=tm[:, None] & vm[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * s_gb + t * s_gt + h * s_gh, mask=tm, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * s_bb + t * s_bt + h * s_bh, mask=tm, other=0.0).to(tl.float32)
    G = tl.cumsum(g, axis=0)  # padded rows have g = 0, so they carry G_last

    kb = k * beta[:, None]
    lower = r[:, None] > r[None, :]
    A = tl.dot(kb, tl.trans(k), input_precision=PREC)
    A = tl.where(lower, A * tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
    # (I + A)^-1 = I + N, N strictly lower: row i of N is a + a N with a = -A[i, :]
    # (rows j < i of N are final when row i is formed; a_j = 0 for j >= i)
    N = tl.zeros([BT, BT], dtype=tl.float32)
    n_valid = tl.minimum(T - pid_n * BT, BT)
    for i in range(1, n_valid):
        a = -tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)
        a = a + tl.sum(a[:, None] * N, axis=0)
        N = tl.where(r[:, None] == i, a[None, :], N)
    Minv = N + tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    u = tl.dot(Minv, v * beta[:, None], input_precision=PREC)
    w = tl.dot(Minv, kb * tl.exp(G)[:, None], input_precision=PREC)
    base = scratch + t
    tl.store(u_ptr + base[:, None] * DV + vr[None, :], u, mask=tm[:, None] & vm[None, :])
    tl.store(w_ptr + base[:, None] * DK + kr[None, :], w, mask=tm[:, None] & km[None, :])
    tl.store(G_ptr + base, G, mask=tm)


@triton.jit
def _chunk_fwd_kernel(act_ptr, w_ptr, u_ptr, G_ptr, s0_ptr, o_ptr, sT_ptr, cu_ptr, T, T_ALL,
                      s_ab, s_at, s_ob, s_ot, s_oh,
                      HV, REP, KEY_DIM, scale,
                      DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      BT: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HV
    h = pid_bh % HV
    if VARLEN:
        bos, T = segment(cu_ptr, b)
        act_ptr += bos * s_at
        o_ptr += bos * s_ot
        scratch = h * T_ALL + bos
    else:
        scratch = pid_bh * T
    hk = h // REP
    r = tl.arange(0, BT)
    kr = tl.arange(0, BK)
    km = kr < DK
    vr = pid_v * BV + tl.arange(0, BV)
    vm = vr < DV
    smask = km[:, None] & vm[None, :]
    s_off = pid_bh * DK * DV + kr[:, None] * DV + vr[None, :]
    S = tl.load(s0_ptr + s_off, mask=smask, other=0.0)  # [BK, BV] fp32
    causal = r[:, None] >= r[None, :]
    for n in range(tl.cdiv(T, BT)):
        t = n * BT + r
        tm = t < T
        rows = act_ptr + b * s_ab + t[:, None] * s_at
        mk = tm[:, None] & km[None, :]
        q = tl.load(rows + hk * DK + kr[None, :], mask=mk, other=0.0).to(tl.float32)
        k = tl.load(rows + KEY_DIM + hk * DK + kr[None, :], mask=mk, other=0.0).to(tl.float32)
        q = l2norm_rows(q) * scale
        k = l2norm_rows(k)
        base = scratch + t
        last = tl.minimum(n * BT + BT, T) - 1
        G_last = tl.load(G_ptr + scratch + last)
        G = tl.load(G_ptr + base, mask=tm, other=0.0)
        G = tl.where(tm, G, G_last)
        w = tl.load(w_ptr + base[:, None] * DK + kr[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + base[:, None] * DV + vr[None, :], mask=tm[:, None] & vm[None, :], other=0.0)
        v_new = u - tl.dot(w, S, input_precision=PREC)  # [BT, BV]
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        P = tl.where(causal, qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(G)[:, None], S, input_precision=PREC) + tl.dot(P, v_new, input_precision=PREC)
        tl.store(o_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + vr[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])
        kd = k * tl.exp(G_last - G)[:, None]
        S = S * tl.exp(G_last) + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
    tl.store(sT_ptr + s_off, S, mask=smask)


def conv_silu(mixed, ring, conv_weight, cu_seqlens=None, longest=None):
    """silu(causal_conv(mixed, ring)) [B, T, C] in mixed's dtype, and the new ring. Varlen
    (``cu_seqlens`` [N + 1], mixed [1, T, C], ring [N, C, K-1]): each segment over its own ring;
    ``longest``: the longest segment's length."""
    B, T, C = mixed.shape
    K = conv_weight.shape[1]
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    act = torch.empty(B, T, C, dtype=mixed.dtype, device=mixed.device)
    new_ring = torch.empty(rows, C, K - 1, dtype=ring.dtype, device=ring.device)
    longest = T if cu_seqlens is None else longest
    BT = min(16, triton.next_power_of_2(max(longest, 1)))
    BC = 128
    grid = (triton.cdiv(C, BC), max(triton.cdiv(longest, BT), 1), rows)
    batch = 0 if cu_seqlens is not None else 1  # varlen: the token axis is not per row
    _conv_silu_kernel[grid](
        mixed, ring, conv_weight, act, new_ring, mixed if cu_seqlens is None else cu_seqlens, T, C,
        mixed.stride(0) * batch, mixed.stride(1), ring.stride(0), ring.stride(1), ring.stride(2),
        act.stride(0) * batch, act.stride(1), new_ring.stride(0), new_ring.stride(1), new_ring.stride(2),
        K=K, BT=BT, BC=BC, VARLEN=cu_seqlens is not None, num_warps=4,
    )
    return act, new_ring


def gdn_commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim, out=None,
               chunk_size: int | None = None):
    """Same contract as ``gdn.naive.gdn_commit``: (o [B, T, Hv, dv] in mixed's dtype,
    new ring in ring's dtype, new state fp32). The input state is not modified. ``out``: the
    kernels write o there (through its strides) and return it.
    ``chunk_size`` None: CHUNK_SIZE, or CHUNK_SIZE_FP32 for fp32 inputs."""
    B, T, C, K, Hv = check_gdn_shapes("gdn_commit", mixed, ring, conv_weight, state,
                                      num_k_heads, head_k_dim, head_v_dim)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"gdn_commit: {name} must be [{B}, {T}, {Hv}], got {tuple(t.shape)}")
    if T == 0:
        o = torch.empty(B, 0, Hv, head_v_dim, dtype=mixed.dtype, device=mixed.device) if out is None else out
        return o, ring.clone(), state.to(torch.float32).clone()
    return _commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim, out, chunk_size,
                   None, T)


def gdn_commit_varlen(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim, cu_seqlens,
                      max_seqlen: int | None = None, out=None, chunk_size: int | None = None):
    """The commit of N rows' segments packed on one token axis (flash-linear-attention's
    ``cu_seqlens`` convention): segment n is tokens [cu_seqlens[n], cu_seqlens[n + 1]) of mixed
    [1, T, C], g and beta [1, T, Hv], committed over ring[n] [C, K-1] and state[n] [Hv, dk, dv]
    (ring [N, C, K-1], state [N, Hv, dk, dv] fp32). A segment may be empty (its ring and state
    come back as they were). Returns (o [1, T, Hv, dv] in mixed's dtype, new ring [N, C, K-1],
    new state [N, Hv, dk, dv] fp32), each segment's exactly what ``gdn_commit`` gives it alone
    (reference: ``gdn.torch.gdn_commit_varlen``).

    ``max_seqlen``: the longest segment's length, which sizes the grid; None reads it from
    cu_seqlens (one host transfer; then cu_seqlens is also checked). Given, nothing is read on the
    host (a CUDA graph can capture the call): cu_seqlens must then start at 0, not decrease and end
    at T, and no segment may be longer than max_seqlen."""
    N, longest = check_segments("gdn_commit_varlen", mixed, cu_seqlens, max_seqlen, ring=ring, state=state)
    T = mixed.shape[1]
    _, _, _, _, Hv = check_gdn_shapes("gdn_commit_varlen", mixed.expand(N, -1, -1), ring, conv_weight, state,
                                      num_k_heads, head_k_dim, head_v_dim)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (1, T, Hv):
            raise ValueError(f"gdn_commit_varlen: {name} must be [1, {T}, {Hv}], got {tuple(t.shape)}")
    return _commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, head_k_dim, head_v_dim, out, chunk_size,
                   cu_seqlens, longest)


def _commit(mixed, ring, conv_weight, g, beta, state, num_k_heads, dk, dv, out, chunk_size, cu_seqlens, longest):
    """The launches of a commit: dense (``cu_seqlens`` None: B rows of T tokens) or varlen (the rows'
    segments on one token axis, ``longest`` the longest)."""
    B, T, C = mixed.shape
    rows = B if cu_seqlens is None else state.shape[0]
    Hv = state.shape[1]
    name = "gdn_commit" if cu_seqlens is None else "gdn_commit_varlen"
    if chunk_size is None:
        chunk_size = CHUNK_SIZE_FP32 if mixed.dtype == torch.float32 else CHUNK_SIZE
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"{name}: chunk_size {chunk_size} must be a power of two >= 16")
    mixed = last_dim_contiguous(mixed)
    conv_weight = conv_weight.contiguous()
    s0 = state.to(torch.float32).contiguous()
    if out is not None:
        check_out(name, out, (B, T, Hv, dv), mixed.dtype)
    o = torch.empty(B, T, Hv, dv, dtype=mixed.dtype, device=mixed.device) if out is None else out
    s_final = torch.empty_like(s0)
    act, new_ring = conv_silu(mixed, ring, conv_weight, cu_seqlens, longest)
    varlen = cu_seqlens is not None
    cu = cu_seqlens if varlen else mixed  # (not read by the dense kernels)
    batch = 0 if varlen else 1  # varlen: the token axis is not per row (its batch strides 0)
    key_dim = num_k_heads * dk
    rep = Hv // num_k_heads
    BK = max(16, triton.next_power_of_2(dk))
    BDV = max(16, triton.next_power_of_2(dv))
    # dv tile of the sequential kernels: small enough to keep S [dk, BV] and the chunk's
    # q, k, w tiles in registers, and to give B * Hv * dv/BV programs (256 for Hv=32, dv=128:
    # about two per SM of an H200)
    BV = min(BDV, 16 if BK >= 128 else 64)
    grid_v = (triton.cdiv(dv, BV), rows * Hv)
    prec = dot_precision(mixed.dtype)
    if longest <= RECURRENT_MAX_T:
        _recurrent_kernel[grid_v](
            act, g, beta, s0, o, s_final, cu, T,
            act.stride(0) * batch, act.stride(1), g.stride(0) * batch, g.stride(1), g.stride(2),
            beta.stride(0) * batch, beta.stride(1), beta.stride(2), o.stride(0) * batch, o.stride(1), o.stride(2),
            Hv, rep, key_dim, dk ** -0.5,
            DK=dk, DV=dv, BK=BK, BV=BV, VARLEN=varlen, num_warps=4,
        )
        return o, new_ring, s_final
    BT = chunk_size
    # scratch [B * Hv, T, ...]; varlen [Hv, T, ...] over the packed axis
    w = torch.empty(B * Hv, T, dk, dtype=torch.float32, device=mixed.device)
    u = torch.empty(B * Hv, T, dv, dtype=torch.float32, device=mixed.device)
    G = torch.empty(B * Hv, T, dtype=torch.float32, device=mixed.device)
    warps = 8 if BK * BT >= 2048 else 4
    _chunk_prep_kernel[(max(triton.cdiv(longest, BT), 1), rows * Hv)](
        act, g, beta, w, u, G, cu, T, T,
        act.stride(0) * batch, act.stride(1), g.stride(0) * batch, g.stride(1), g.stride(2),
        beta.stride(0) * batch, beta.stride(1), beta.stride(2),
        Hv, rep, key_dim,
        DK=dk, DV=dv, BK=BK, BDV=BDV, BT=BT, PREC=prec, VARLEN=varlen, num_warps=warps,
    )
    _chunk_fwd_kernel[grid_v](
        act, w, u, G, s0, o, s_final, cu, T, T,
        act.stride(0) * batch, act.stride(1), o.stride(0) * batch, o.stride(1), o.stride(2),
        Hv, rep, key_dim, dk ** -0.5,
        DK=dk, DV=dv, BK=BK, BV=BV, BT=BT, PREC=prec, VARLEN=varlen, num_warps=warps,
    )
    return o, new_ring, s_final
