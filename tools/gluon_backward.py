"""Check and time the Gluon one-pass backward (course_lib/kernels/gluon_backward.py) on a Hopper GPU.

    PYTHONPATH=. python tools/gluon_backward.py --part errors        # about a minute
    PYTHONPATH=. python tools/gluon_backward.py --part speed --out gluon_backward.json

``errors``: what the compiled kernel uses (registers, spills, shared memory, ``setmaxnreg``), then
the error of dQ, dK and dV against a float64 reference on ragged shapes (fp16/bf16, causal or not,
a (B, N, H, d) stride case), next to the error of chapter 07's Triton backward on the same inputs.
``speed``: TFLOP/s of forward+backward of ``course_lib.flash_attention`` with the Gluon backward
and without it (``COURSE_LIB_GLUON_BACKWARD=0``: chapter 07's Triton backward), and of SDPA's
cuDNN backend, on the bench grid's d = 128 cells (CUDA-graph median, ``course_lib.measure.bench``'s timer
and FLOP count); the backward alone is forward+backward minus forward. Run each part under
``timeout``: a barrier that never completes hangs the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from course_lib.measure import bench
from course_lib.attention.reference import naive_attention_torch

CHECK_SHAPES = [(2, 3, 1000, 128), (1, 2, 2111, 128), (1, 1, 64, 128), (2, 3, 1000, 64)]
DTYPES = ("float16", "bfloat16")
SEQ_LENS = (1024, 4096, 16384)
# Max abs gradient error allowed, against float64, relative to the largest reference gradient.
REL_TOL = {"float16": 1e-2, "bfloat16": 6e-2}


def _grads_ref(q, k, v, do, causal):
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o, _ = naive_attention_torch(q64, k64, v64, causal=causal)
    o.backward(do.double())
    return o.detach(), q64.grad, k64.grad, v64.grad


def check_errors() -> list[dict]:
    from course_lib.kernels import gluon_backward as gb
    from course_lib.kernels.api import _forward
    from course_lib.kernels.backward import attention_backward

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in CHECK_SHAPES:
        for dtype in DTYPES:
            for causal in (False, True):
                for layout in ("contiguous", "bnhd") if shape[2:] == (1000, 128) else ("contiguous",):
                    b, h, n, d = shape
                    dt = getattr(torch, dtype)

                    def make():
                        if layout == "bnhd":
                            return torch.randn(b, n, h, d, device="cuda", dtype=dt, generator=gen).transpose(1, 2)
                        return torch.randn(shape, device="cuda", dtype=dt, generator=gen)

                    q, k, v, do = make(), make(), make(), make()
                    scale = d ** -0.5
                    o, lse = _forward(q, k, v, causal, scale)
                    _, dq_ref, dk_ref, dv_ref = _grads_ref(q, k, v, do, causal)
                    row = {"shape": list(shape), "dtype": dtype, "causal": causal, "layout": layout}
                    ok = True
                    for name, fn in (("gluon", lambda: gb.attention_backward_gluon(do, q, k, v, o, lse, causal, scale)),
                                     ("triton", lambda: attention_backward(do, q, k, v, o, lse, causal, scale))):
                        try:
                            grads = fn()
                            torch.cuda.synchronize()
                            for g, ref, label in zip(grads, (dq_ref, dk_ref, dv_ref), ("dq", "dk", "dv")):
                                row[f"{name}_{label}"] = (g.double() - ref).abs().max().item() / ref.abs().max().item()
                            if name == "gluon":
                                ok = all(row[f"gluon_{x}"] <= REL_TOL[dtype] for x in ("dq", "dk", "dv"))
                        except Exception as err:  # noqa: BLE001 - report and go on
                            row[f"{name}_error"] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
                            ok = False
                    row["ok"] = ok
                    rows.append(row)
                    print(f"  {str(shape):18} {dtype:9} causal={causal!s:5} {layout:10} "
                          + " ".join(f"{k_}={v_:.1e}" if isinstance(v_, float) else f"{k_}={v_}"
                                     for k_, v_ in row.items() if k_.startswith(("gluon", "triton")))
                          + ("" if ok else "   <-- FAIL"), flush=True)
    return rows


def speed() -> list[dict]:
    rows = []
    for dtype in DTYPES:
        for n in SEQ_LENS:
            for causal in (False, True):
                for impl, env in (("course_gluon_bwd", "1"), ("course_triton_bwd", "0"), ("sdpa_cudnn", "1")):
                    os.environ["COURSE_LIB_GLUON_BACKWARD"] = env
                    cell = {}
                    for pass_ in ("fwd", "fwd+bwd"):
                        r = bench.measure("course" if impl.startswith("course") else impl, dtype, 128, n, causal, pass_)
                        cell[pass_] = r and r["tflops"]
                    batch, heads = bench.problem_shape(n, 128)
                    bwd = None
                    if cell["fwd"] and cell["fwd+bwd"]:
                        def ms(pass_):
                            return bench.flops(batch, heads, n, 128, causal, pass_) / (cell[pass_] * 1e12) * 1e3

                        bwd_ms = ms("fwd+bwd") - ms("fwd")
                        bwd = round((bench.flops(batch, heads, n, 128, causal, "fwd+bwd")
                                     - bench.flops(batch, heads, n, 128, causal, "fwd")) / (bwd_ms * 1e-3) / 1e12, 1)
                    row = {"impl": impl, "dtype": dtype, "N": n, "causal": causal, "fwd": cell["fwd"],
                           "fwd+bwd": cell["fwd+bwd"], "bwd": bwd}
                    rows.append(row)
                    print(f"  {impl:18} {dtype:9} N={n:<6} causal={causal!s:5} fwd {cell['fwd']} "
                          f"fwd+bwd {cell['fwd+bwd']} bwd {bwd} TFLOP/s", flush=True)
    os.environ.pop("COURSE_LIB_GLUON_BACKWARD", None)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("errors", "speed"), required=True)
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs a Hopper GPU (compute capability 9.x)")
    from course_lib.kernels import gluon_backward as gb

    out = {"meta": bench.machine_meta()}
    if args.part == "errors":
        q = torch.randn(1, 1, 256, 128, device="cuda", dtype=torch.float16)
        lse = torch.zeros(1, 1, 256, device="cuda")
        gb.attention_backward_gluon(q, q, q, q, q, lse, True, 128 ** -0.5)
        torch.cuda.synchronize()
        out["compile"] = gb.gluon_hopper.kernel_facts(gb.attention_backward_gluon.last_kernel)
        print(" ", out["compile"], flush=True)
        out["errors"] = check_errors()
        print(f"{sum(r['ok'] for r in out['errors'])} of {len(out['errors'])} checks within tolerance")
    else:
        out["speed"] = speed()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
