"""The one-pass backward against the two-kernel backward on a GPU, per config (chapter 07, issue 21).

For each cell of the bench grid (dtype × d × N × causal, ``batch · N = 16k`` tokens, ``heads · d =
2048``) it times ``attention_backward`` alone (the forward is run once, outside the timing):

- ``two-kernel``: ``deterministic=True`` with the table's configs (fitted to the GPU);
- ``one-pass <mode> <config>``: ``deterministic=False`` with dQ added by ``atomic`` (one fp32
  atomic add per element) or ``tma`` (one TMA reduce-add per tile, Hopper), for each config.

It prints backward TFLOP/s (2.5× the forward's FLOPs, the FlashAttention papers' convention), the
largest difference of each gradient from the two-kernel result, and whether two runs of each
gave bit-identical gradients. JSON rows go to ``--out``.

    python tools/bench_backward.py --out bwd.json
    python tools/bench_backward.py --dtypes float16 --head-dims 128 --configs 64/64/8/2,32/128/8/2
"""

from __future__ import annotations

import argparse
import json
import statistics

DEFAULT_CONFIGS = {64: "32/128/4/3,64/128/8/3,64/128/8/2,64/64/4/3,64/64/4/2,32/64/4/3",
                   128: "64/128/8/3,64/128/8/2,64/64/8/2,64/64/8/3,32/128/8/2,32/128/8/3"}


def main(argv=None) -> int:
    from course_lib.measure import bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_grid_arguments(parser)
    parser.add_argument("--modes", default="atomic,tma")
    parser.add_argument("--configs", default="", help="BLOCK_M/BLOCK_N/warps/stages,... for every d; "
                        "'table' is the library's own choice")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    import torch
    import triton

    from course_lib.platform import runtime
    from course_lib.kernels import backward, forward, tuning

    runtime.setup()
    modes = {"atomic": backward.DQ_ATOMIC.value, "tma": backward.DQ_TMA.value}
    rows = []
    real_mode = backward.dq_mode
    tuning.one_pass_pays = lambda *shape: True  # time the one-pass backward at every N
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for d in map(int, args.head_dims.split(",")):
            configs = [None if c == "table" else tuning.parse_blocks(c)
                       for c in (args.configs or DEFAULT_CONFIGS[d]).split(",")]
            for n in map(int, args.seq_lens.split(",")):
                for causal in (c == "1" for c in args.causal.split(",")):
                    batch, heads = bench.problem_shape(n, d)
                    gen = torch.Generator(device="cuda").manual_seed(n + d)
                    q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=gen)
                                   for _ in range(4))
                    o, lse = forward.attention_forward(q, k, v, causal, d ** -0.5)
                    flops = 2.5 * bench.flops(batch, heads, n, d, causal, "fwd")
                    variants = [("two-kernel", None, None)] + [
                        (f"one-pass {m}", m, c) for m in args.modes.split(",") for c in configs]
                    ref = None
                    for label, mode, blocks in variants:
                        if mode is not None:
                            backward.dq_mode = lambda *a, m=mode: modes[m]
                        run = (lambda: backward.attention_backward(do, q, k, v, o, lse, causal, d ** -0.5,
                                                                   dkdv_blocks=blocks, deterministic=mode is None))
                        try:
                            first, second = run(), run()
                            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                        except Exception as exc:  # a config that does not fit: say so and go on
                            print(f"{dtype_name} d={d} N={n} causal={int(causal)} {label} {blocks}: "
                                  f"{type(exc).__name__}: {str(exc)[:120]}", flush=True)
                            continue
                        finally:
                            backward.dq_mode = real_mode
                        if ref is None:
                            ref = first
                        row = {"dtype": dtype_name, "d": d, "N": n, "causal": causal, "variant": label,
                               "config": None if blocks is None else [blocks.block_m, blocks.block_n,
                                                                       blocks.num_warps, blocks.num_stages],
                               "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                               "max_diff": [round((a.float() - b.float()).abs().max().item(), 6)
                                            for a, b in zip(first, ref)],
                               "bitwise_repeatable": all(torch.equal(a, b) for a, b in zip(first, second))}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    best = {}
    for r in rows:
        key = (r["dtype"], r["d"], r["N"], r["causal"])
        if r["variant"] == "two-kernel":
            best.setdefault(key, {})["two"] = r["tflops"]
        else:
            cur = best.setdefault(key, {}).get("one")
            if cur is None or r["tflops"] > cur[0]:
                best[key]["one"] = (r["tflops"], r["variant"], r["config"])
    ratios = []
    for key, b in best.items():
        if "two" in b and "one" in b:
            ratios.append(b["one"][0] / b["two"])
            print(f"{key}: two-kernel {b['two']} TFLOP/s, best one-pass {b['one'][0]} ({b['one'][1]} "
                  f"{b['one'][2]}): {b['one'][0] / b['two']:.2f}x")
    if ratios:
        print(f"median best one-pass / two-kernel: {statistics.median(ratios):.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": bench.machine_meta(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
