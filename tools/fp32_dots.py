"""fp32 on the GPU: first-call compile time, accuracy and speed of the library's fp32 path, for
each way of computing fp32 dot products (kernels/forward.py): "auto" (the library's choice),
"tf32x3" or "ieee" forced everywhere, or "before", the choice before tuning.FP32_WIDE (tf32x3 up
to head dim 128; above it ieee in every kernel, on the 4-warp 64x32 / 32x64 tiles).

Each (precision, head dim) runs in a fresh process with an empty Triton cache, so the first call
pays the whole compile, as a learner's first fp32 call does. Prints a table and writes JSON:

    python tools/fp32_dots.py --out fp32_dots.json                  # auto, d 64-256
    python tools/fp32_dots.py --precisions tf32x3,ieee --head-dims 64,128
    python tools/fp32_dots.py --precisions before --head-dims 256 --causal 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PRECISIONS = ("auto", "tf32x3", "ieee", "before")


def use_choice_before_fp32_wide() -> None:
    """Make this process choose fp32 launches as the library did before tuning.FP32_WIDE: every
    kernel keeps ieee dots above head dim 128 and fp32 takes the small-tiles branch of the table."""
    from course_lib.kernels import forward, tuning

    forward.FORWARD_TF32X3_MAX_HEAD_DIM = forward.TF32X3_MAX_HEAD_DIM
    tuning.FP32_WIDE = {}


def _child(d: int, seq_len: int, batch_heads: int, causals=(False, True), before: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    import triton

    from course_lib import flash_attention
    from course_lib.platform import runtime
    from course_lib.kernels import fit

    runtime.setup(verbose=False)
    if before:
        use_choice_before_fp32_wide()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, batch_heads, seq_len, d, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(1, batch_heads, seq_len, d, device="cuda")
    result = {"d": d}
    for causal in causals:
        for x in (q, k, v):
            x.grad = None  # the previous mask's timing loop leaves its gradients behind
        start = time.perf_counter()
        o = flash_attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        result[f"first_forward_s_causal{int(causal)}"] = time.perf_counter() - start
        start = time.perf_counter()
        o.backward(do)
        torch.cuda.synchronize()
        result[f"first_backward_s_causal{int(causal)}"] = time.perf_counter() - start
        grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        o64.backward(do.double())
        result[f"max_err_o_causal{int(causal)}"] = (o.double() - o64).abs().max().item()
        result[f"max_err_grads_causal{int(causal)}"] = max(
            (g.double() - x.grad).abs().max().item() for g, x in zip(grads, (q64, k64, v64)))

        def fwd_bwd():
            out = flash_attention(q, k, v, causal=causal)
            out.backward(do)

        result[f"fwd_ms_causal{int(causal)}"] = triton.testing.do_bench(
            lambda: flash_attention(q, k, v, causal=causal), return_mode="median")
        result[f"fwd_bwd_ms_causal{int(causal)}"] = triton.testing.do_bench(
            fwd_bwd, grad_to_none=[q, k, v], return_mode="median")
    result["kernels"] = [{"kernel": c.kernel, "config": list(map(str, [c.chosen.blocks])),
                          "dots": c.meta.get("DOT_PRECISION"), "causal": c.meta.get("CAUSAL"),
                          "compile_s": round(sum(t.compile_s for t in c.tried), 2),
                          "shared": c.chosen.shared, "registers": c.chosen.registers,
                          "spill_bytes": c.chosen.spill_bytes, "tried": len(c.tried)}
                         for c in fit.CHOICES.values()]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default="auto", help=f"comma-separated, among {', '.join(PRECISIONS)}")
    parser.add_argument("--head-dims", default="64,128,160,256")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-heads", type=int, default=16)
    parser.add_argument("--causal", default="0,1", help="0, 1 or 0,1: which masks to compile and time")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--before", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        causals = tuple(bool(int(c)) for c in args.causal.split(","))
        print("RESULT " + json.dumps(_child(args.child, args.seq_len, args.batch_heads, causals, args.before)),
              flush=True)
        return 0
    precisions = args.precisions.split(",")
    if not set(precisions) <= set(PRECISIONS):
        parser.error(f"--precisions must be among {', '.join(PRECISIONS)}, got {args.precisions!r}")
    rows = []
    for precision in precisions:
        for d in map(int, args.head_dims.split(",")):
            dots = "auto" if precision == "before" else precision
            env = dict(os.environ, COURSE_LIB_FP32_DOTS=dots, TRITON_CACHE_DIR=tempfile.mkdtemp())
            start = time.perf_counter()
            done = subprocess.run([sys.executable, __file__, "--child", str(d), "--seq-len", str(args.seq_len),
                                   "--batch-heads", str(args.batch_heads), "--causal", args.causal]
                                  + (["--before"] if precision == "before" else []), env=env, cwd=ROOT,
                                  capture_output=True, text=True)
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"{precision} d={d}: failed\n{done.stderr[-2000:]}", flush=True)
                continue
            row = dict(json.loads(lines[0][7:]), precision=precision, process_s=time.perf_counter() - start)
            rows.append(row)
            parts = [f"{precision:<7} d={d:<4}"]
            for c in args.causal.split(","):
                parts.append(f"[causal={c}] first fwd {row[f'first_forward_s_causal{c}']:5.1f} s, first bwd "
                             f"{row[f'first_backward_s_causal{c}']:5.1f} s, max|o-o64| {row[f'max_err_o_causal{c}']:.1e}, "
                             f"max|grad-grad64| {row[f'max_err_grads_causal{c}']:.1e}, fwd {row[f'fwd_ms_causal{c}']:.2f} ms, "
                             f"fwd+bwd {row[f'fwd_bwd_ms_causal{c}']:.2f} ms")
            print("  ".join(parts), flush=True)
            for kern in row["kernels"]:
                print(f"        {kern['kernel']:<26} causal={kern['causal']!s:<5} {kern['dots']!s:<6} "
                      f"{kern['config'][0]:<60} compile {kern['compile_s']:5.1f} s  "
                      f"shared {kern['shared'] / 1024:.0f} KiB  regs {kern['registers']}  spills {kern['spill_bytes']} B",
                      flush=True)
    if args.out:
        from course_lib.measure import bench

        args.out.write_text(json.dumps({**bench.machine_meta(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
