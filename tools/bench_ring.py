"""Time the course's ring attention, and PyTorch's context_parallel, over several processes.

One process per GPU over NCCL (default), or gloo processes on the CPU with ``--cpu`` (the Triton
interpreter: tiny sizes only). For each total sequence length and causal setting it times the
forward and the forward+backward of ``course_lib.ring.ring_attention`` (zig-zag shards by
default), the fraction of each step spent waiting for the transfer after the compute (the part of
the communication *not* hidden), peak memory per GPU, and ``context_parallel`` around SDPA on the
same shapes where it runs. Prints a table and writes JSON with provenance
(``course_lib/data/benchmarks/`` style: ``{"meta": ..., "rows": [...]}``).

    python tools/bench_ring.py --world 8 --n 32768 131072 524288          # GPUs, NCCL
    python tools/bench_ring.py --cpu --world 2 --n 64 --d 16 --heads 1     # CPU, gloo

Keep NVLink multicast off on shared machines: NCCL_NVLS_ENABLE=0 (set here if unset).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import bench, ring

FLOP_FWD = 4  # 4·B·H·N²·d for the forward (halved when causal), ×3.5 for forward+backward
FWD_BWD_FACTOR = 3.5


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeats, device):
    fn()  # warm-up (compilation, NCCL communicators)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def worker(rank, world, configs, repeats, device, dtype_name):
    dtype = getattr(torch, dtype_name)
    rows = []
    for n, d, heads, causal, layout in configs:
        case = ring.RingCase((n // world,) * world, causal=causal, layout=layout, d=d, heads=heads,
                             dtype="float32", backward=False)
        q, k, v, do = (x.to(device, dtype) for x in case.inputs())
        shards = [ring.shard(x, rank, world, layout) for x in (q, k, v, do)]
        qs, ks, vs = (x.clone().requires_grad_(True) for x in shards[:3])
        trace: list = []

        def fwd():
            with torch.no_grad():
                ring.ring_attention(qs, ks, vs, causal, layout=layout)

        def fwd_bwd():
            ring.ring_attention(qs, ks, vs, causal, layout=layout).backward(shards[3])

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        row = {"N": n, "world": world, "d": d, "heads": heads, "causal": causal, "layout": layout,
               "dtype": dtype_name, "fwd_ms": 1e3 * _timed(fwd, repeats, device),
               "fwd_bwd_ms": 1e3 * _timed(fwd_bwd, repeats, device)}
        ring.ring_attention(qs, ks, vs, causal, layout=layout, trace=trace)  # one traced forward
        busy = sum(t["compute_s"] for t in trace)
        wait = sum(t["wait_s"] for t in trace)
        row["fwd_wait_fraction"] = wait / (busy + wait) if busy + wait else 0.0
        row["bytes_per_step"] = ring.step_bytes(1, heads, n // world, d, qs.element_size())["kv"]
        if device == "cuda":
            row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        flops = FLOP_FWD * heads * n * n * d * (0.5 if causal else 1.0)
        row["tflops_per_rank_fwd"] = flops / world / (row["fwd_ms"] * 1e-3) / 1e12
        row["tflops_per_rank_fwd_bwd"] = (FWD_BWD_FACTOR * flops / world
                                          / (row["fwd_bwd_ms"] * 1e-3) / 1e12)
        try:
            row["context_parallel_fwd_ms"] = 1e3 * _timed(
                lambda: ring.torch_context_parallel(q, k, v, causal, device_type=device), repeats,
                device)
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            row["context_parallel"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
    return rows if rank == 0 else None


def meta(device, world, backend) -> dict:
    if device == "cuda":
        data = bench.machine_meta()
    else:
        import triton

        data = {"gpu": f"none: CPU ({platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cores), Triton interpreter", "driver": "n/a",
                "torch": torch.__version__, "triton": triton.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    return {**data, "world": world, "backend": backend}


def format_rows(rows) -> str:
    lines = [f"{'N':>8} {'W':>2} {'causal':>6} {'fwd ms':>9} {'fwd+bwd ms':>11} "
             f"{'TF/s/rank':>9} {'wait':>5} {'context_parallel fwd':>22}"]
    for r in rows:
        cp = (f"{r['context_parallel_fwd_ms']:.2f} ms" if "context_parallel_fwd_ms" in r
              else "not run")
        lines.append(f"{r['N']:8d} {r['world']:2d} {str(r['causal']):>6} {r['fwd_ms']:9.2f} "
                     f"{r['fwd_bwd_ms']:11.2f} {r['tflops_per_rank_fwd_bwd']:9.3g} "
                     f"{r['fwd_wait_fraction']:5.0%} {cp:>22}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: all GPUs, or 2)")
    parser.add_argument("--n", type=int, nargs="+", default=None, help="total sequence lengths")
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--layout", default="zigzag", choices=ring.LAYOUTS)
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU: use --cpu")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = args.world or (2 if args.cpu else torch.cuda.device_count())
    n_list = args.n or ([16 * world] if args.cpu else [32768, 131072, 524288])
    d = args.d or (16 if args.cpu else 128)
    heads = args.heads or (1 if args.cpu else 8)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    repeats = args.repeats or (1 if args.cpu else 5)
    configs = [(n, d, heads, c, args.layout) for n in n_list for c in causals]
    backend = "gloo" if args.cpu else "nccl"
    dtype = "float32" if args.cpu else "bfloat16"
    rows = ring.run_ranks(worker, world, configs, repeats, device, dtype, backend=backend,
                          timeout_s=1800)[0]
    data = {"meta": meta(device, world, backend), "rows": rows}
    print(bench.provenance(data))
    print(format_rows(rows))
    if args.out:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
