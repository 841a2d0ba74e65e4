"""Block-size sweep behind the tuning notes (``course_lib/data/benchmarks/NOTES.md``). GPU only.

``python -m course_lib.kernels.sweep`` times the forward and the backward kernels at fp16,
d ∈ {64, 128}, N = 4096 (16k tokens, heads·d = 2048), causal and not, for each fixed config in
``FORWARD`` / ``BACKWARD`` and for the autotuner's pick, and prints TFLOP/s (bench.py's FLOP
convention: the backward alone counts 2.5× the forward).
"""

from __future__ import annotations

import torch
import triton

from course_lib.bench import flops, problem_shape
from course_lib.kernels.backward import attention_backward
from course_lib.kernels.forward import attention_forward
from course_lib.kernels.tuning import Blocks

FORWARD = [Blocks(64, 64, 4, 3), Blocks(128, 64, 4, 3), Blocks(128, 64, 8, 3), Blocks(128, 128, 8, 3),
           Blocks(128, 64, 4, 2), Blocks(128, 32, 4, 3)]
BACKWARD = [(Blocks(32, 128, 4, 3), Blocks(128, 32, 4, 3)), (Blocks(64, 128, 8, 3), Blocks(128, 64, 8, 3)),
            (Blocks(32, 64, 4, 3), Blocks(64, 32, 4, 3)), (Blocks(64, 64, 4, 3), Blocks(64, 64, 4, 3))]


def _tflops(fl, fn) -> float:
    return fl / (triton.testing.do_bench(fn, return_mode="median") * 1e-3) / 1e12


def main():
    n = 4096
    for d in (64, 128):
        batch, heads = problem_shape(n, d)
        q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.float16) for _ in range(4))
        for causal in (False, True):
            fl = flops(batch, heads, n, d, causal, "fwd")
            o, lse = attention_forward(q, k, v, causal, d ** -0.5)
            cells = [f"{'auto':>16}: {_tflops(fl, lambda: attention_forward(q, k, v, causal, d ** -0.5)):6.1f}"]
            for b in FORWARD:
                cells.append(f"{str((b.block_m, b.block_n, b.num_warps, b.num_stages)):>16}: "
                             f"{_tflops(fl, lambda: attention_forward(q, k, v, causal, d ** -0.5, b)):6.1f}")
            print(f"fwd d={d} causal={causal}: " + " | ".join(cells), flush=True)
            bwd = 2.5 * fl
            cells = [f"{'auto':>16}: "
                     f"{_tflops(bwd, lambda: attention_backward(do, q, k, v, o, lse, causal, d ** -0.5)):6.1f}"]
            for b1, b2 in BACKWARD:
                t = _tflops(bwd, lambda: attention_backward(do, q, k, v, o, lse, causal, d ** -0.5, b1, b2))
                cells.append(f"{str((b1.block_m, b1.block_n, b1.num_warps, b1.num_stages)):>16}: {t:6.1f}")
            print(f"bwd d={d} causal={causal}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
