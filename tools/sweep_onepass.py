"""Cross-compile the backward kernels for a GPU we may not have (default sm_90) and print shared
memory, registers and spills per config: the two-kernel backward (dK/dV, dQ) and the one-pass
backward (dK/dV with dQ atomics or TMA reduce-adds). Runs on the CPU (course_lib.measure.reach's stand-in
driver). Used to choose the one-pass configs before timing them on an H100:

    python tools/sweep_onepass.py --head-dims 64,128 --dtypes float16
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--modes", default="atomic,tma", help="dq modes of the one-pass kernel")
    parser.add_argument("--configs", default="", help="BLOCK_M/BLOCK_N/warps/stages,... (default: a sweep)")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime import driver

    from course_lib.platform import runtime
    from course_lib.measure.reach import StandInDriver

    runtime.use_stand_in_gpu(f"sm_{args.arch}")
    driver.set_active(StandInDriver(args.arch))
    import torch

    from course_lib.kernels import backward, fit, forward, tuning
    from course_lib.kernels.tuning import Blocks

    if args.configs:
        configs = [tuning.parse_blocks(c) for c in args.configs.split(",")]
    else:
        configs = [Blocks(m, n, w, s) for (m, n) in ((32, 64), (64, 64), (32, 128), (64, 128), (128, 64), (128, 128))
                   for w in (4, 8) for s in (2, 3)]
    modes = {"atomic": backward.DQ_ATOMIC.value, "tma": backward.DQ_TMA.value}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for d in map(int, args.head_dims.split(",")):
            n = 4096
            q = torch.zeros(1, 1, n, d, dtype=dtype)
            lse = torch.zeros(1, 1, n)
            acc, precision = forward.kernel_dtypes(dtype, forward.padded_head_dim(d))
            meta = dict(HEAD_DIM_REAL=d, HEAD_DIM=forward.padded_head_dim(d), ACC_DTYPE=acc, CAUSAL=False,
                        DOT_PRECISION=precision)
            dq_acc = torch.zeros(1, 1, n, d)
            strides = (*q.stride(),) * 4
            dkdv_args = (q, q, q, q, lse, lse, *strides, q, q, *q.stride(), dq_acc, 1, n, n, 0.1, 0.14)
            variants = [("two-kernel dkdv", dict(meta))] + [
                (f"one-pass {m}", dict(meta, DQ_MODE=code)) for m, code in modes.items() if m in args.modes]
            for label, m in variants:
                for blocks in configs:
                    loaded = fit._load(backward.dkdv_kernel, blocks, dkdv_args, m, fit._tile_args)
                    print(json.dumps({"dtype": dtype_name, "d": d, "variant": label,
                                      "config": [blocks.block_m, blocks.block_n, blocks.num_warps, blocks.num_stages],
                                      "shared_kib": round(loaded.shared / 1024, 1), "fits": loaded.fits,
                                      "registers": loaded.registers, "spill_bytes": loaded.spill_bytes,
                                      "compile_s": round(loaded.compile_s, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
