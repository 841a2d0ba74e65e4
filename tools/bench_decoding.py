"""Benchmark split-KV decoding (chapter 08): ``flash_decode_triton`` vs SDPA, in HBM bandwidth.

Decoding is memory-bound (:func:`course_lib.attention.decoding.decode_step_cost`: ~1 FLOP per byte), so
the figure of merit is the achieved HBM bandwidth — bytes of K and V read divided by the time —
as a fraction of a ceiling measured on the same GPU: a device-to-device copy
(``torch.Tensor.copy_`` of a large buffer, counting its read and its write).

Grid: batch 1–64, cache length 4k–128k, fp16, GQA (32 query heads, 8 K/V heads, d = 128: a
Llama-style layer) unless told otherwise. SDPA runs with ``enable_gqa=True`` (torch >= 2.5) and
picks its own backend. Results go to a JSON file with provenance (GPU, versions, date).

Needs a CUDA GPU; ``--help`` works anywhere.

    python tools/bench_decoding.py --out decoding.json
    python tools/bench_decoding.py --batch 1 8 --seq-len 4096 131072 --splits 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

# Run from a checkout without installing: the repository root holds course_lib.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_SEQ_LENS = (4096, 16384, 65536, 131072)
# A Llama-style layer: 32 query heads sharing 8 K/V heads of dim 128.
DEFAULT_HEADS, DEFAULT_KV_HEADS, DEFAULT_HEAD_DIM = 32, 8, 128
# The copy ceiling: a buffer far larger than L2 (50 MiB on an H100), so the copy streams HBM.
COPY_CEILING_BYTES = 2**30
# Skip configurations whose cache would not leave room for the copy buffers and the workspace.
MAX_CACHE_FRACTION_OF_MEMORY = 0.5


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time flash_decode_triton against SDPA (enable_gqa) and report achieved HBM "
                    "bandwidth (bytes of K+V read / time) as a fraction of a measured "
                    "device-to-device copy ceiling. Needs a CUDA GPU.")
    p.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES),
                   help="batch sizes (default: %(default)s)")
    p.add_argument("--seq-len", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS),
                   help="KV-cache lengths N (default: %(default)s)")
    p.add_argument("--heads", type=int, default=DEFAULT_HEADS, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=DEFAULT_KV_HEADS, help="K/V heads H_kv")
    p.add_argument("--head-dim", type=int, default=DEFAULT_HEAD_DIM, help="head dim d")
    p.add_argument("--splits", type=int, default=None,
                   help="force the number of splits (default: the library's choice)")
    p.add_argument("--out", default="bench_decoding.json", help="JSON file to write")
    return p.parse_args(argv)


def copy_ceiling_bytes_per_s(torch, do_bench) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), measured now."""
    src = torch.empty(COPY_CEILING_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * COPY_CEILING_BYTES / (ms * 1e-3)


def sdpa_decode(F, q, k, v):
    """SDPA on one query per head: ``(B, H, 1, d)`` against ``(B, H_kv, N, d)``."""
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("bench_decoding: no CUDA GPU — nothing to measure (run it on a GPU machine)",
              file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from course_lib.platform import runtime

    runtime.setup()
    from course_lib.kernels.api import MAX_ELEMENT_OFFSET
    from course_lib.kernels.decoding import MAX_GROUPED_ROWS, choose_splits, flash_decode_triton

    ceiling = copy_ceiling_bytes_per_s(torch, do_bench)
    props = torch.cuda.get_device_properties(0)
    dtype = torch.float16
    element = torch.finfo(dtype).bits // 8
    rows = []
    for batch in args.batch:
        for n in args.seq_len:
            kv_bytes = 2 * batch * args.kv_heads * n * args.head_dim * element  # K and V, read once
            if kv_bytes > MAX_CACHE_FRACTION_OF_MEMORY * props.total_memory:
                print(f"skip batch {batch}, N {n}: the cache ({kv_bytes / 2**30:.1f} GiB) is too large")
                continue
            if batch * args.kv_heads * n * args.head_dim > MAX_ELEMENT_OFFSET + 1:
                print(f"skip batch {batch}, N {n}: K spans more elements than the kernels' 32-bit "
                      f"offsets reach")
                continue
            q = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=dtype)
            k = torch.randn(batch, args.kv_heads, n, args.head_dim, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            grouped = args.heads // args.kv_heads <= MAX_GROUPED_ROWS  # as flash_decode_triton
            splits = args.splits or choose_splits(batch, args.kv_heads if grouped else args.heads, n)
            ours = flash_decode_triton(q, k, v, splits=splits)[0]
            ref = sdpa_decode(F, q, k, v).reshape(q.shape)
            max_err = float((ours.float() - ref.float()).abs().max())
            row = {"batch": batch, "seq_len": n, "splits": splits, "grouped": grouped,
                   "kv_bytes": kv_bytes,
                   "max_abs_err_vs_sdpa": max_err}
            for name, fn in (("triton", lambda: flash_decode_triton(q, k, v, splits=splits)),
                             ("sdpa", lambda: sdpa_decode(F, q, k, v))):
                ms = do_bench(fn)
                bandwidth = kv_bytes / (ms * 1e-3)
                row[name] = {"ms": ms, "bytes_per_s": bandwidth,
                             "fraction_of_copy_ceiling": bandwidth / ceiling}
            rows.append(row)
            print(f"B={batch:3d} N={n:7d} S={splits:3d}  triton {row['triton']['ms']:.3f} ms "
                  f"({row['triton']['fraction_of_copy_ceiling']:.0%} of copy)  sdpa "
                  f"{row['sdpa']['ms']:.3f} ms ({row['sdpa']['fraction_of_copy_ceiling']:.0%})")
            del q, k, v
    report = {
        "what": "split-KV decoding: flash_decode_triton vs SDPA(enable_gqa), fp16",
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
        "bandwidth_definition": "bytes of K+V read once / mean time (triton.testing.do_bench, return_mode='mean', its default)",
        "copy_ceiling_bytes_per_s": ceiling,
        "copy_ceiling_definition": f"dst.copy_(src) of {COPY_CEILING_BYTES} bytes, read + write",
        "provenance": {"gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
                       "torch": torch.__version__, "triton": triton.__version__,
                       "cuda": torch.version.cuda, "python": platform.python_version(),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
        "results": rows,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
