"""Exact two-pass fixed-point attention over the int8 KV cache (docs/spec.md §4.1).

Dot products and the P·V sum are exact integers; numpy computes them as float64 matmuls,
which is exact because every partial sum is an integer below 2**53. Everything else is
float32, element-wise, in the spec's order.
"""
import numpy as np

from .numerics import F32, LOG2E, TWO_24, exp2s, int_to_f32, nan_ignoring_max, quantize_rows, sigmoid


def key_range(pos0, n_tok, window, instruction=0):
    """[lo, hi): the cached positions that queries pos0 .. pos0+T-1 can see (spec §4.1)."""
    lo = max(0, pos0 - window + 1) if window else 0
    return lo, max(pos0 + n_tok, instruction if pos0 < instruction else 0)


def visible_keys(query_pos, key_pos, window, instruction=0):
    """(T, S) bool: key j is visible from query t (j <= e(t), and inside the window if W > 0)."""
    last = np.where(query_pos < instruction, instruction - 1, query_pos)
    mask = key_pos[None, :] <= last[:, None]
    if window:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def attend(qh, kq, sk, vq, sv, visible):
    """Attention of T queries over S cached keys.

    qh: (T, H, D) float32 queries after RoPE; kq, vq: (S, G, D) int8; sk, sv: (S, G) float32;
    visible: (T, S) bool. Returns (T, H * D) float32.
    """
    n_tok, n_heads, head_dim = qh.shape
    n_kv = kq.shape[1]
    group = n_heads // n_kv
    qq, sq = quantize_rows(qh)                         # (T, H, D), (T, H)
    c = sq / np.sqrt(F32(head_dim))
    vis = visible[:, None, :]                          # (T, 1, S)
    out = np.empty((n_tok, n_heads, head_dim), F32)
    for g in range(n_kv):
        heads = slice(g * group, (g + 1) * group)
        dots = qq[:, heads].astype(np.float64) @ kq[:, g].astype(np.float64).T   # (T, h, S)
        scores = (int_to_f32(dots) * c[:, heads, None]) * sk[None, None, :, g]
        m = nan_ignoring_max(scores, where=vis)
        e = np.where(vis, exp2s((scores - m[..., None]) * LOG2E), F32(0))
        den = np.rint(e * TWO_24).astype(np.float64).sum(axis=-1)                 # (T, h)
        sv_g = np.broadcast_to(sv[None, :, g], visible.shape)
        svmax = nan_ignoring_max(sv_g, where=visible)                             # (T,)
        live = svmax > 0
        kappa = TWO_24 / np.where(live, svmax, F32(1))
        with np.errstate(invalid="ignore"):       # a hidden key's sv may be inf: 0 * inf
            u = np.where(vis, np.rint(e * (sv[None, None, :, g] * kappa[:, None, None])), 0.0)
        num = u.astype(np.float64) @ vq[:, g].astype(np.float64)                 # (T, h, D)
        o = (int_to_f32(num) / int_to_f32(den)[..., None]) * svmax[:, None, None]
        out[:, heads] = np.where(live[:, None, None], o, F32(0))
    return out.reshape(n_tok, n_heads * head_dim)


def attend_cached(qh, cache, layer, pos0, window=None):
    """Attention of T queries at positions pos0 .. pos0+T-1 over one layer of a KVCache,
    through the cache's window or `window` (loop attention's local window, local_window).

    qh: (T, H, D) float32. Reads the visible keys as contiguous arrays; returns (T, H * D).
    """
    window = cache.window if window is None else window
    lo, hi = key_range(pos0, len(qh), window, cache.instruction)
    visible = visible_keys(np.arange(pos0, pos0 + len(qh)), np.arange(lo, hi), window,
                           cache.instruction)
    return attend(qh, *cache.read(layer, lo, hi), visible)


def local_window(window, loop_window):
    """W' of loop attention's local branch (spec §4): W_l, or min(W, W_l) when the sequence
    has a window W."""
    return min(window, loop_window) if window else loop_window


def loop_mix(qh, global_out, local_out, gate):
    """Loop attention's gated mix (spec §4): per query head h, g = sig(((f32)(qq . gw_h) *
    sq) * gs_h + gb_h) on Q8 of the head's query, then g * global + (1 - g) * local.

    qh: (T, H, D) float32 queries after RoPE; global_out, local_out: (T, H * D) float32;
    gate: a LoopGate (w (H, D) int8, s, b (H,) float32). Returns (T, H * D) float32.
    """
    n_tok, n_heads, head_dim = qh.shape
    qq, sq = quantize_rows(qh)                                            # (T, H, D), (T, H)
    dots = np.einsum("thd,hd->th", qq.astype(np.int64), np.asarray(gate.w, np.int64))
    g = sigmoid(((int_to_f32(dots) * sq) * gate.s) + gate.b)[..., None]   # (T, H, 1)
    mixed = (g * global_out.reshape(qh.shape)) + ((F32(1) - g) * local_out.reshape(qh.shape))
    return mixed.reshape(n_tok, n_heads * head_dim)
