"""The forward's config and program-order search on a GPU (issue 21): for each cell of the bench
grid (dtype × d × N × causal, 16k tokens, heads · d = 2048) it times the library's forward (the
pointer kernel at d=64, the TMA kernel at d=128 on Hopper) for the table's config and for each
candidate config, and, when causal, the table's config in each program order of
``tiles.program_tile_ordered``. Times are medians of the call replayed in a CUDA graph
(``triton.testing.do_bench_cudagraph``), so launch overhead is left out and N = 1k repeats.

    python tools/sweep_forward.py --out sweep_forward.json
"""

from __future__ import annotations

import argparse
import json

CANDIDATES = {64: "128/64/8/3,128/64/4/2,128/64/4/3,64/64/4/3,64/64/4/2,128/128/8/3,128/32/4/3,64/128/4/3",
              128: "128/128/8/3,128/128/8/2,128/64/8/3,128/64/4/2,64/64/4/3,64/64/4/2,64/128/4/3,128/64/8/2"}


def main(argv=None) -> int:
    from course_lib.measure import bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_grid_arguments(parser)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    import torch
    import triton

    from course_lib.platform import runtime
    from course_lib.kernels import api, tuning

    runtime.setup()
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for d in map(int, args.head_dims.split(",")):
            for n in map(int, args.seq_lens.split(",")):
                for causal in (c == "1" for c in args.causal.split(",")):
                    batch, heads = bench.problem_shape(n, d)
                    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(3))
                    fl = bench.flops(batch, heads, n, d, causal, "fwd")
                    tma = api.hopper.library_uses_tma(q, k, v)
                    variants = [("table", None, 0)]
                    variants += [(c, tuning.parse_blocks(c), 0) for c in CANDIDATES[d].split(",")]
                    if causal:
                        variants += [(f"table order {o}", None, o) for o in (1, 2)]
                    for label, blocks, order in variants:
                        tuning.CAUSAL_ORDER = order

                        def run():
                            if tma:
                                return api.hopper.attention_forward_tma(q, k, v, causal, d ** -0.5, blocks=blocks)
                            return api.attention_forward(q, k, v, causal, d ** -0.5, blocks)
                        try:
                            run()
                            ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
                        except Exception as exc:  # a config that does not fit: say so, go on
                            print(f"{dtype_name} d={d} N={n} causal={int(causal)} {label}: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:100]}", flush=True)
                            continue
                        finally:
                            tuning.CAUSAL_ORDER = 0
                        rows.append({"dtype": dtype_name, "d": d, "N": n, "causal": causal, "kernel":
                                     "tma" if tma else "pointer", "variant": label, "order": order,
                                     "tflops": round(fl / ms / 1e9, 1)})
                    cell = [r for r in rows if (r["dtype"], r["d"], r["N"], r["causal"]) == (dtype_name, d, n, causal)]
                    table = next((r["tflops"] for r in cell if r["variant"] == "table"), float("nan"))
                    best = max(cell, key=lambda r: r["tflops"])
                    print(f"{dtype_name} d={d} N={n} causal={int(causal)} ({cell[0]['kernel']}): table {table}, "
                          f"best {best['variant']} {best['tflops']} ({best['tflops'] / table:.2f}x) | "
                          + " ".join(f"{r['variant']}:{r['tflops']:.0f}" for r in cell), flush=True)
                    del q, k, v
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": bench.machine_meta(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
