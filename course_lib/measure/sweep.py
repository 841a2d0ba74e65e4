"""Block-size sweep behind the tuning notes (``course_lib/data/benchmarks/NOTES.md``). GPU only.

``python -m course_lib.measure.sweep [--seq-len 1024 4096 ...] [--dtype float16 ...] [--out F]``
times the forward and the backward kernels at d ∈ {64, 128} (16k tokens, heads·d = 2048), causal
and not, for each fixed config in ``FORWARD`` / ``BACKWARD`` and for the autotuner's pick, and
prints TFLOP/s (bench.py's FLOP convention: the backward alone counts 2.5× the forward); ``--out``
saves every number as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from course_lib.measure.bench import flops, problem_shape
from course_lib.kernels.backward import attention_backward
from course_lib.kernels.forward import attention_forward
from course_lib.kernels.tuning import Blocks

FORWARD = [Blocks(64, 64, 4, 3), Blocks(128, 64, 4, 3), Blocks(128, 64, 8, 3), Blocks(128, 128, 8, 3),
           Blocks(128, 64, 4, 2), Blocks(128, 32, 4, 3)]
BACKWARD = [(Blocks(32, 128, 4, 3), Blocks(128, 32, 4, 3)), (Blocks(64, 128, 8, 3), Blocks(128, 64, 8, 3)),
            (Blocks(32, 64, 4, 3), Blocks(64, 32, 4, 3)), (Blocks(64, 64, 4, 3), Blocks(64, 64, 4, 3))]


def _tflops(fl, fn) -> float:
    return fl / (triton.testing.do_bench(fn, return_mode="median") * 1e-3) / 1e12


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m course_lib.measure.sweep")
    p.add_argument("--seq-len", nargs="+", type=int, default=[4096])
    p.add_argument("--dtype", nargs="+", default=["float16"], choices=["float16", "bfloat16"])
    p.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    for dtype in args.dtype:
        for n in args.seq_len:
            for d in args.head_dim:
                rows += _sweep_cell(getattr(torch, dtype), dtype, n, d)
                if args.out:
                    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _sweep_cell(torch_dtype, dtype, n, d):
    batch, heads = problem_shape(n, d)
    q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch_dtype) for _ in range(4))
    rows = []
    for causal in (False, True):
        fl = flops(batch, heads, n, d, causal, "fwd")
        o, lse = attention_forward(q, k, v, causal, d ** -0.5)
        fwd = {"auto": _tflops(fl, lambda: attention_forward(q, k, v, causal, d ** -0.5))}
        for b in FORWARD:
            fwd[str((b.block_m, b.block_n, b.num_warps, b.num_stages))] = \
                _tflops(fl, lambda: attention_forward(q, k, v, causal, d ** -0.5, b))
        bwd_fl = 2.5 * fl
        bwd = {"auto": _tflops(bwd_fl, lambda: attention_backward(do, q, k, v, o, lse, causal, d ** -0.5))}
        for b1, b2 in BACKWARD:
            bwd[str((b1.block_m, b1.block_n, b1.num_warps, b1.num_stages))] = \
                _tflops(bwd_fl, lambda: attention_backward(do, q, k, v, o, lse, causal, d ** -0.5, b1, b2))
        for pass_, cells in (("fwd", fwd), ("bwd", bwd)):
            rows.append({"dtype": dtype, "N": n, "d": d, "causal": causal, "pass": pass_, "tflops": cells})
            print(f"{dtype} N={n} {pass_} d={d} causal={causal}: "
                  + " | ".join(f"{name:>16}: {t:6.1f}" for name, t in cells.items()), flush=True)
    return rows


if __name__ == "__main__":
    main()
