"""The numba kernels of kvbench.kernels.numba_splitk (imported on first use: numba is an
optional extra). Module-level functions, so numba's on-disk cache finds them again in the
next process; defined inside a function, the ones that call another were compiled anew by
every process (their closure is part of the cache key).
"""

import numpy as np
from numba import njit

# nogil: plain Python threads run these in parallel. numba's own parallel layers were
# measured to fight torch's OpenMP pool (torch's static decode slowed by up to half after
# a splitk run), and their idle threads spin; Python pool threads sleep.


@njit(nogil=True, fastmath=True, cache=True)
def gemm_rows(a, w, out, first, last):
    """out = a[:, first:last] @ w[first:last]; a [M, K], w [K, N], M small.

    Streams rows first..last-1 of w once, as one contiguous run (the hardware prefetcher
    follows it; splitting by columns instead gave every thread short strided runs and
    half the read rate). Four rows per pass: each load and store of `out` serves four.
    """
    M, N = out.shape
    acc = np.zeros((M, N), dtype=a.dtype)  # private: lets LLVM vectorize
    stop4 = first + (last - first) // 4 * 4
    for k in range(first, stop4, 4):
        r0, r1, r2, r3 = w[k], w[k + 1], w[k + 2], w[k + 3]
        for m in range(M):
            c0, c1, c2, c3 = a[m, k], a[m, k + 1], a[m, k + 2], a[m, k + 3]
            acc_m = acc[m]
            for j in range(N):
                acc_m[j] += c0 * r0[j] + c1 * r1[j] + c2 * r2[j] + c3 * r3[j]
    for k in range(stop4, last):
        row = w[k]
        for m in range(M):
            coef = a[m, k]
            acc_m = acc[m]
            for j in range(N):
                acc_m[j] += coef * row[j]
    out[:, :] = acc

@njit(nogil=True, fastmath=True, cache=True)
def chunk(qs, kk, vv, m_out, l_out, acc_out):
    """One chunk of one KV head. qs [G, D] (pre-scaled); kk, vv [n, D].

    Writes the chunk's max score m_out [G], exp-sum l_out [G] and exp-weighted V sum
    acc_out [G, D]. Loops index from 0 over slices: numba then needs no negative-index
    checks, which halved the read rate when they were there.
    """
    G, D = qs.shape
    n = kk.shape[0]
    scores = np.empty((G, n), dtype=np.float32)
    for t in range(n):  # one pass over K: each row serves all G queries
        row = kk[t]
        for g in range(G):
            qg = qs[g]
            dot = np.float32(0.0)
            for d in range(D):
                dot += qg[d] * row[d]
            scores[g, t] = dot
    for g in range(G):
        sg = scores[g]
        m = np.float32(-np.inf)
        for t in range(n):
            m = max(m, sg[t])
        total = np.float32(0.0)
        for t in range(n):
            e = np.exp(sg[t] - m)
            sg[t] = e
            total += e
        m_out[g] = m
        l_out[g] = total
    gemm_rows(scores, vv, acc_out, 0, n)  # one pass over V: acc_out = P @ V

@njit(nogil=True, fastmath=True, cache=True)
def partial(q, k, v, lengths, chunks, m_part, l_part, acc_part, first, last):
    """Work items first..last-1; item = (b·H_kv + h)·chunks + c is chunk c of KV head h
    of sequence b. q [B, H_kv, G, D] (pre-scaled); k, v [B, H_kv, T_max, D]; sequence b
    reads its first lengths[b] positions, in chunks sized by the longest.
    """
    Hkv = q.shape[1]
    size = (lengths.max() + chunks - 1) // chunks
    for item in range(first, last):
        bh, c = item // chunks, item % chunks
        b, h = bh // Hkv, bh % Hkv
        start, stop = c * size, min(lengths[b], (c + 1) * size)
        if stop <= start:
            l_part[bh, c, :] = 0.0
            continue
        chunk(q[b, h], k[b, h, start:stop], v[b, h, start:stop], m_part[bh, c],
              l_part[bh, c], acc_part[bh, c])

@njit(nogil=True, fastmath=True, cache=True)
def merge(m_part, l_part, acc_part, out):
    """Chunks -> out [B, H_kv, G, D], weighting each by exp(its max - the global max)."""
    B, Hkv, G, D = out.shape
    chunks = m_part.shape[1]
    for bh in range(B * Hkv):
        b, h = bh // Hkv, bh % Hkv
        for g in range(G):
            m = np.float32(-np.inf)
            for c in range(chunks):
                if l_part[bh, c, g] > 0:
                    m = max(m, m_part[bh, c, g])
            total = np.float32(0.0)
            acc = np.zeros(D, dtype=np.float32)
            for c in range(chunks):
                if l_part[bh, c, g] > 0:
                    w = np.exp(m_part[bh, c, g] - m)
                    total += w * l_part[bh, c, g]
                    for d in range(D):
                        acc[d] += w * acc_part[bh, c, g, d]
            for d in range(D):
                out[b, h, g, d] = acc[d] / total
