"""What each step from the teaching kernel to the library kernel buys, measured (GPU only).

``python tools/ablation.py`` times, at fp16, N = 4096, batch·N = 16k tokens, heads·d = 2048:

1. chapter 06's teaching kernel with the natural exponential (``tl.exp``), 64×64 tiles;
2. the same kernel with exp2 and the scale folded into one multiply;
3. the library kernel with its fixed GPU config (masks only on diagonal/ragged tiles, larger
   tiles, more warps, software pipelining);
4. the library kernel autotuned.

and prints TFLOP/s (bench.py's FLOP convention) and each step's ratio to the one before.
"""

from __future__ import annotations

import os

import torch
import triton

from course_lib.platform import runtime

rt = runtime.setup()
from course_lib.measure.bench import flops, problem_shape  # noqa: E402
from course_lib.teaching.exercises import ch06  # noqa: E402
from course_lib.kernels import tuning  # noqa: E402
from course_lib.kernels.forward import attention_forward  # noqa: E402

N = 4096


def tflops(fl, fn) -> float:
    fn()
    return fl / (triton.testing.do_bench(fn, return_mode="median") * 1e-3) / 1e12


def main():
    print(f"{rt.gpu_name}, torch {torch.__version__}, triton {triton.__version__}; fp16, N = {N}")
    print(f"{'d':>4} {'causal':>6} | {'teach exp':>9} {'teach exp2':>10} {'lib fixed':>9} {'lib auto':>9} | "
          f"{'exp2':>5} {'lib':>5} {'tune':>5}")
    for d in (64, 128):
        batch, heads = problem_shape(N, d)
        q, k, v = (torch.randn(batch, heads, N, d, device="cuda", dtype=torch.float16) for _ in range(3))
        scale = d ** -0.5
        for causal in (False, True):
            fl = flops(batch, heads, N, d, causal, "fwd")
            fixed = tuning.gpu_default("forward", d, 2)
            t = [
                tflops(fl, lambda: ch06.forward(q, k, v, causal, scale, pieces=ch06.NATURAL_EXP_PIECES, blocks=(64, 64))),
                tflops(fl, lambda: ch06.forward(q, k, v, causal, scale, pieces=ch06.LIBRARY_PIECES, blocks=(64, 64))),
                tflops(fl, lambda: attention_forward(q, k, v, causal, scale, fixed)),
                tflops(fl, lambda: attention_forward(q, k, v, causal, scale)),
            ]
            print(f"{d:>4} {str(causal):>6} | {t[0]:>9.1f} {t[1]:>10.1f} {t[2]:>9.1f} {t[3]:>9.1f} | "
                  f"{t[1] / t[0]:>5.2f} {t[2] / t[1]:>5.2f} {t[3] / t[2]:>5.2f}")


if __name__ == "__main__":
    os.environ.setdefault("COURSE_LIB_AUTOTUNE", "1")
    main()
