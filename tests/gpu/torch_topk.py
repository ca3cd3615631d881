#!/usr/bin/env python3
"""torch.topk on |N(0,1)| data, timed like gpu_bench times the segmented top-k:
k = max(1, n // 100), median of REPEATS calls, CUDA events, a 256 MiB write
before each call to evict the L2.  Prints one line per size and variant:

    TORCH topk_unsorted <n> <ms>
    TORCH topk_sorted   <n> <ms>

topk_unsorted (sorted=False) is the fair comparison: the SCAPE mask is not
ordered either.  Exits 77 with "SKIP: <reason>" when torch or CUDA is absent.
"""
import statistics
import sys

REPEATS = 9
FLUSH_BYTES = 256 << 20


def time_topk(torch, x, k, flush, sorted_):
    """Median milliseconds of torch.topk(x, k) with the L2 flushed before each."""
    torch.topk(x, k, sorted=sorted_)  # warm-up: allocator, kernel selection
    times = []
    for r in range(REPEATS):
        flush.fill_(r & 0xFF)
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.topk(x, k, sorted=sorted_)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main(argv):
    try:
        import torch
    except ImportError as exc:
        print(f"SKIP: torch_topk: cannot import torch ({exc})")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: torch_topk: torch sees no CUDA device")
        return 77
    sizes = [int(float(s)) for s in argv[1:]] or [10**6, 10**7, 10**8]
    torch.manual_seed(0)
    data = torch.randn(max(sizes), device="cuda").abs_()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for n in sizes:
        k = max(1, n // 100)
        for name, sorted_ in (("topk_unsorted", False), ("topk_sorted", True)):
            ms = time_topk(torch, data[:n], k, flush, sorted_)
            print(f"TORCH {name:<14} {n:>10} {ms:10.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
