#!/usr/bin/env python3
"""A projection, not a measurement: the step time of one GH200 node of TACC
Vista for a GPT of 1.8e9 parameters, from the engine's own byte counters and
stated bandwidths.

For every executor (host, and cuda through the sim executor, which runs the
cuda executor's code and counts its bytes the same way), R daemons
(8, 16, 32, 64), and SCAPE at rho 0.01 and 0.1 and dense AdamS, it runs
tests/bench/bench_counters on a copy of the GPT's layout with every tensor
scaled down by --scale, takes the slowest rank's bytes per phase (through the
state's memory, between host and device, and on the wire), scales them up to
the full size (the small tensors' k_l = max(1, ceil(rho len)) makes the
scaled layout's K a little larger than the full one's), and divides each by
the bandwidth it crosses:

  HBM3 of the H100 on a GH200 (the cuda executor's state)  4000 GB/s
  NVLink-C2C, each direction                                 450 GB/s
  Grace LPDDR5X (the host executor's state)                  500 GB/s
  NDR InfiniBand, each direction                              50 GB/s

The host executor on Vista also moves the trainers' CUDA IPC buffers through
pinned copies (gradients in, parameters out: the server's handover, counted
there, not by the engine); the cuda executor reads them in place. A phase's
time is the sum of its parts (no overlap between them, peak bandwidths:
a floor under the real time, not a forecast). The deferred selection runs
after the reply, behind the trainers' compute, and is shown apart. Next to
each projection: the same configuration's measured time on this machine at
the run's scale (the CPU figures).

usage: project.py BUILD_DIR [--scale S] [--markdown FILE] [--ranks 8,16,32,64]
"""
import argparse
import json
import os
import subprocess
import sys

PHASES = ["intake", "mask_wait", "select", "pack", "reduce", "update", "gather",
          "writeback"]
OPS = ["allreduce", "reduce_scatter", "allgather", "iallgather", "broadcast", "barrier"]
BW = {"hbm": 4000e9, "c2c": 450e9, "grace": 500e9, "ndr": 50e9}


def counters(build, executor, ranks, rho, scale):
    exe = os.path.join(build, "tests", "bench", "bench_counters")
    cmd = [exe, "--executor", executor, "--ranks", str(ranks), "--scale", str(scale),
           "--steps", "2"]
    cmd += ["--dense"] if rho >= 1.0 else ["--rho", str(rho)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def full_size():
    """N of bench_counters' GPT layout at scale 1."""
    d, layers, vocab, ctx = 2048, 34, 50304, 2048
    per_layer = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return vocab * d + ctx * d + layers * sum(per_layer) + 2 * d


def project(c, n_full, executor):
    f = n_full / c["n"]
    mem_bw = BW["hbm"] if executor == "sim" else BW["grace"]
    per = {}
    for i, ph in enumerate(PHASES):
        t = f * c["mem_bytes"][i] / mem_bw
        # the link's bytes go both ways in the pack (residual in and out)
        t += f * c["link_bytes"][i] / (2 * BW["c2c"])
        per[ph] = t
    wire = c["wire_bytes"]
    per["reduce"] += f * (wire[OPS.index("allreduce")] + wire[OPS.index("reduce_scatter")]) \
        / BW["ndr"]
    per["gather"] += f * wire[OPS.index("allgather")] / BW["ndr"]
    mask_net = f * wire[OPS.index("iallgather")] / BW["ndr"]
    handover = 0.0
    if executor == "host":  # staged CUDA IPC buffers: grads in, params out (fp32)
        handover = 2 * 4 * n_full / BW["c2c"]
    reply = sum(v for k, v in per.items() if k != "select") + handover
    return reply, per["select"], mask_net, handover, f


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--scale", type=float, default=1e-3)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    n_full = full_size()
    rows = []
    for executor in ("host", "sim"):
        for rho in (0.01, 0.1, 1.0):
            for ranks in [int(x) for x in a.ranks.split(",")]:
                c = counters(a.build, executor, ranks, rho, a.scale)
                reply, sel, mask_net, handover, f = project(c, n_full, executor)
                here = sum(s for i, s in enumerate(c["seconds"]) if PHASES[i] != "select")
                rows.append({
                    "executor": "cuda" if executor == "sim" else "host",
                    "opt": "adams" if rho >= 1.0 else "scape rho=%g" % rho,
                    "R": ranks, "K": c["k"] * f,
                    "mem": f * sum(c["mem_bytes"]), "link": f * sum(c["link_bytes"]),
                    "net": f * (sum(c["wire_bytes"]) - c["wire_bytes"][OPS.index("iallgather")]),
                    "reply_ms": 1e3 * reply, "select_ms": 1e3 * sel,
                    "mask_ms": 1e3 * mask_net, "handover_ms": 1e3 * handover,
                    "here_ms": 1e3 * here, "n_run": c["n"], "launches": c["launches"]})
                print("projected %s %s R=%d: %.2f ms to the reply" %
                      (rows[-1]["executor"], rows[-1]["opt"], ranks, rows[-1]["reply_ms"]),
                      file=sys.stderr, flush=True)
    head = ("| executor | optimizer | R | K (full size) | state memory GB/step | "
            "host-device GB/step | wire GB/step | projected ms to the reply | of it handover "
            "ms | selection after the reply ms | mask all-gather on the wire ms | measured "
            "here ms (N = %d) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            % rows[0]["n_run"])
    lines = [head]
    for r in rows:
        lines.append("| %s | %s | %d | %.3g | %.2f | %.2f | %.4f | %.2f | %.2f | %.2f | %.3f | "
                     "%.2f |" % (r["executor"], r["opt"], r["R"], r["K"], r["mem"] / 1e9,
                                 r["link"] / 1e9, r["net"] / 1e9, r["reply_ms"],
                                 r["handover_ms"], r["select_ms"], r["mask_ms"], r["here_ms"]))
    text = ("Projection (not a measurement) for a GPT of %.3g parameters on GH200 nodes; "
            "bytes from the engine's counters at scale %g, bandwidths HBM %g, C2C %g per "
            "direction, Grace %g, NDR %g GB/s.\n\n" % (n_full, a.scale, BW["hbm"] / 1e9,
                                                       BW["c2c"] / 1e9, BW["grace"] / 1e9,
                                                       BW["ndr"] / 1e9)) + "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
