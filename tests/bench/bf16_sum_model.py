#!/usr/bin/env python3
"""bf16_sum_model - what NCCL's bf16 sum of bf16 values costs against the fp32
sum the host backend takes, in a model (not a measurement on a GPU).

With wire_values: bf16 every rank sends s_r = bf16(a_r).  Both backends add
the s_r in fp32 in rank order (exact inputs, one fp32 rounding per
addition; the nccl backend sends the parts to their owners to do so).
Passing ncclBfloat16 to an NCCL reduction instead would round each partial
sum to bf16 as it moves along the ring: partial_1 = s_0, partial_{k+1} =
bf16(partial_k + s_k) in fp32 arithmetic (the model; NCCL may pick a tree
or another order), a loss error feedback cannot give back.  This is why the
nccl backend does not.  This prints, for R ranks and values
drawn like a gradient (a shared signal plus per-rank noise, magnitudes over
several decades), the relative error of the bf16 ring sum and of the fp32
sum against the exact sum, and how often the bf16 ring sum differs from the
fp32 one.  numpy only.

Usage: bf16_sum_model.py [--n N] [--ranks 2,4,8,16,64] [--markdown FILE]
"""
import argparse

import numpy as np


def bf16(x):
    """fp32 -> bf16 (round to nearest even), held in fp32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--ranks", default="2,4,8,16,64")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    rng = np.random.default_rng(20261201)
    rows = ["| ranks | bf16 ring sum: median rel. error | p99 | fp32 sum: median rel. error | "
            "bf16 ring != fp32 sum |", "|---|---|---|---|---|"]
    scale = np.float32(10.0) ** rng.uniform(-6, -1, a.n).astype(np.float32)
    signal = rng.standard_normal(a.n).astype(np.float32)
    for R in [int(r) for r in a.ranks.split(",")]:
        s = [bf16(scale * (0.5 * signal + rng.standard_normal(a.n).astype(np.float32)))
             for _ in range(R)]
        exact = np.sum(np.stack(s).astype(np.float64), axis=0)
        f32 = s[0].copy()
        ring = s[0].copy()
        for k in range(1, R):
            f32 = (f32 + s[k]).astype(np.float32)
            ring = bf16((ring + s[k]).astype(np.float32))
        ok = exact != 0
        e16 = np.abs(ring[ok] - exact[ok]) / np.abs(exact[ok])
        e32 = np.abs(f32[ok] - exact[ok]) / np.abs(exact[ok])
        rows.append("| %d | %.2e | %.2e | %.2e | %.1f%% |" % (
            R, np.median(e16), np.percentile(e16, 99), np.median(e32),
            100.0 * np.mean(ring != f32)))
    print("\n".join(rows))
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
