"""Chapter 09's measurements on a Hopper GPU: descriptor (TMA) loads, pipelining depth, warp
specialization, the two-stage causal loop and FP8, one at a time, against FlashAttention-2 and
cuDNN (PyTorch's SDPA backends) on ``course_lib.measure.bench``'s grid.

    python tools/fa3_ablation.py --out h100_fa3.json          # everything (~6 min on an H100)
    python tools/fa3_ablation.py --quick                      # d=128, N=4k only

What it writes (JSON, with provenance: GPU, driver, torch, triton, date):

- ``check``: max |error| of the descriptor kernel and the FP8 kernel against a float64 reference
  on ragged shapes, before anything is timed;
- ``rows``: forward TFLOP/s (bench.py's FLOP convention) of every variant on every cell:
  ``course`` (chapter 06's library kernel, pointer loads, its measured config), ``tma`` (the
  descriptor kernel, one row per config, with and without warp specialization, and one-stage),
  ``fp8`` (the FP8 kernel, inputs already quantized; with and without the Hadamard rotation costs
  nothing in the kernel), ``fp8_e2e`` (quantization + rotation included), ``sdpa_flash``,
  ``sdpa_cudnn``;
- ``fp8_accuracy``: RMSE against float64 on inputs with outliers (FA3's experiment), for the
  fp16 kernel and the FP8 kernel with and without the rotation.

Needs a CUDA GPU of compute capability >= 9.0; ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Launch configs tried for the descriptor kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages).
TMA_CONFIGS = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3),
               (128, 128, 8, 2))
WS_CONFIGS = ((128, 64, 8, 3), (128, 128, 8, 3))  # tried again with warp specialization
FP8_CONFIGS = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 4))
WARMUP_MS, REP_MS = 10, 50
ACCURACY_SHAPE = (1, 4, 1024, 128)  # (B, H, N, d) for the FP8 accuracy experiment


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="h100_fa3.json")
    p.add_argument("--quick", action="store_true", help="d=128, N=4096 only")
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 kernel (check, timing, accuracy)")
    p.add_argument("--only-fp8", action="store_true", help="the FP8 kernel only (and the fp16 kernels it is compared with)")
    return p.parse_args(argv)


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every forward kernel compiled so far (pointer and
    descriptor), read from Triton's cache of compiled kernels; the key names the constexprs."""
    from course_lib.kernels import forward, hopper

    out = []
    for name, fn in (("pointer", forward.attention_forward_kernel), ("tma", hopper.attention_forward_tma_kernel)):
        try:
            for cache in fn.device_caches.values():
                for key, kernel in cache[0].items():
                    out.append({"kernel": name, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                "shared_bytes": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                                "num_stages": kernel.metadata.num_stages, "key": str(key)[-400:]})
        except Exception as err:  # the cache layout is Triton-version specific: say so, go on
            out.append({"kernel": name, "error": f"{type(err).__name__}: {err}"})
    return out


def main(argv=None):
    args = parse(argv)
    import torch
    import triton

    from course_lib.platform import runtime

    rt = runtime.setup()
    from course_lib.measure import bench
    from course_lib.kernels import hopper, tuning
    from course_lib.kernels.forward import attention_forward

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("fa3_ablation.py needs a Hopper (sm_90) or newer CUDA GPU")
    data = {"meta": bench.machine_meta(), "check": [], "rows": [], "fp8_accuracy": [], "failures": []}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(data, indent=1))

    # ---- correctness first: ragged shapes, every dtype, against float64
    gen = torch.Generator(device="cuda").manual_seed(1)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        for (b, h, nq, nk, d, causal) in ((2, 3, 1000, 1000, 64, True), (1, 2, 777, 1200, 128, False),
                                          (1, 2, 333, 333, 96, True), (3, 1, 64, 4000, 256, False)):
            q = torch.randn(b, h, nq, d, device="cuda", dtype=dt, generator=gen)
            k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=dt, generator=gen) for _ in range(2))
            ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
            row = {"dtype": str(dt).split(".")[1], "shape": [b, h, nq, nk, d], "causal": causal}
            try:
                o, _ = hopper.attention_forward_tma(q, k, v, causal, d ** -0.5)
                row["tma_err"] = (o.double() - ref).abs().max().item()
                if d % 16 == 0 and not args.no_fp8:
                    o8, _ = hopper.fp8_attention_forward(q, k, v, causal)
                    row["fp8_rel_rmse"] = ((o8.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
            except Exception as err:  # record and go on: the table says what failed
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            data["check"].append(row)
            print("check", row, flush=True)
    save()

    # ---- timing
    dtypes = ("float16",) if args.quick or args.only_fp8 else ("float16", "bfloat16")
    head_dims = (128,) if args.quick else (64, 128)
    seq_lens = (4096,) if args.quick else (4096, 16384) if args.only_fp8 else (1024, 4096, 16384)

    def tflops(fl, fn):
        fn()
        torch.cuda.synchronize()
        return round(fl / (triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") * 1e-3) / 1e12, 1)

    def record(variant, config, dt, d, n, causal, fn, fl, **extra):
        try:
            t = tflops(fl, fn)
        except Exception as err:
            msg = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            data["failures"].append({"variant": variant, "config": config, "dtype": dt, "d": d, "N": n,
                                     "causal": causal, "error": msg})
            print("FAILED", variant, config, dt, d, n, causal, msg, flush=True)
            if "--trace" in sys.argv:
                traceback.print_exc()
            return None
        data["rows"].append({"variant": variant, "config": config, "dtype": dt, "d": d, "N": n,
                             "causal": causal, "tflops": t, **extra})
        return t

    for dt in dtypes:
        for d in head_dims:
            for n in seq_lens:
                for causal in (False, True):
                    batch, heads = bench.problem_shape(n, d)
                    torch_dt = getattr(torch, dt)
                    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch_dt, generator=gen)
                               for _ in range(3))
                    fl = bench.flops(batch, heads, n, d, causal, "fwd")
                    scale = d ** -0.5
                    best = {}
                    lib = tuning.gpu_default("forward", d, 2, seq_len=n, causal=causal)
                    best["course"] = record("course", list(vars(lib).values()), dt, d, n, causal,
                                            lambda: attention_forward(q, k, v, causal, scale), fl)
                    if args.only_fp8:  # chapter 06's kernel on the wide tiles too: what TMA changed
                        wide = tuning.Blocks(*TMA_CONFIGS[1])
                        record("course", list(TMA_CONFIGS[1]), dt, d, n, causal,
                               lambda: attention_forward(q, k, v, causal, scale, blocks=wide), fl)
                    for cfg in (TMA_CONFIGS[:2] if args.only_fp8 else TMA_CONFIGS):
                        blocks = tuning.Blocks(*cfg)
                        t = record("tma", list(cfg), dt, d, n, causal,
                                   lambda: hopper.attention_forward_tma(q, k, v, causal, scale, blocks=blocks), fl)
                        best["tma"] = max(best.get("tma") or 0, t or 0)
                    for cfg in (() if args.only_fp8 else WS_CONFIGS):
                        blocks = tuning.Blocks(*cfg)
                        record("tma_ws", list(cfg), dt, d, n, causal,
                               lambda: hopper.attention_forward_tma(q, k, v, causal, scale, blocks=blocks,
                                                                    warp_specialize=True), fl)
                    if causal and not args.only_fp8:
                        for cfg in TMA_CONFIGS[:2]:
                            blocks = tuning.Blocks(*cfg)
                            record("tma_one_stage", list(cfg), dt, d, n, causal,
                                   lambda: hopper.attention_forward_tma(q, k, v, causal, scale, blocks=blocks,
                                                                        two_stage=False), fl)
                    if dt == "float16" and n >= 4096 and not args.no_fp8:
                        quantized = hopper.quantize_fp8(q, k, v, rotate=True)
                        for cfg in FP8_CONFIGS:
                            blocks = tuning.Blocks(*cfg)
                            record("fp8", list(cfg), dt, d, n, causal,
                                   lambda: hopper.fp8_attention_forward(q, k, v, causal, blocks=blocks,
                                                                        quantized=quantized), fl)
                        record("fp8_e2e", list(FP8_CONFIGS[0]), dt, d, n, causal,
                               lambda: hopper.fp8_attention_forward(q, k, v, causal, blocks=tuning.Blocks(*FP8_CONFIGS[0])), fl)
                    for impl in ("sdpa_flash", "sdpa_cudnn"):
                        fn = bench._attention_fn(impl)
                        with torch.no_grad():
                            best[impl] = record(impl, None, dt, d, n, causal, lambda: fn(q, k, v, causal), fl)
                    print(dt, d, n, causal, {key: val for key, val in best.items()}, flush=True)
                    del q, k, v
                    torch.cuda.empty_cache()
                    save()

    data["resources"] = compiled_resources()
    save()
    if args.no_fp8:
        return data
    # ---- FP8 accuracy on inputs with outliers (FA3's experiment)
    from course_lib.attention import fp8

    b, h, n, d = ACCURACY_SHAPE
    for seed in range(3):
        q, k, v = (fp8.outlier_inputs(ACCURACY_SHAPE, seed=seed * 3 + i).cuda() for i in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        rmse = lambda o: (o.double() - ref).pow(2).mean().sqrt().item()  # noqa: E731
        o16, _ = hopper.attention_forward_tma(q.half(), k.half(), v.half(), False, d ** -0.5)
        o8, _ = hopper.fp8_attention_forward(q.half(), k.half(), v.half(), rotate=False)
        o8r, _ = hopper.fp8_attention_forward(q.half(), k.half(), v.half(), rotate=True, seed=seed)
        data["fp8_accuracy"].append({"seed": seed, "shape": list(ACCURACY_SHAPE), "fp16": rmse(o16),
                                     "fp8": rmse(o8), "fp8_rotated": rmse(o8r)})
        print("fp8 accuracy", data["fp8_accuracy"][-1], flush=True)
    save()
    return data


if __name__ == "__main__":
    main()
