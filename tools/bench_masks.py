"""Masked attention on one GPU: the course's masked kernels against FlexAttention and FA2 varlen.

Run ``python tools/bench_masks.py [--quick] [--out FILE]`` on an H100 (needs a GPU; about 6-7
minutes for the full grid, under a minute with ``--quick``; ``--budget-s`` stops early and says
what it skipped). For d = 128, fp16 and bf16, N = 4k, 8k, 16k, 32k (``batch · N = 16k`` tokens,
``heads · d = 2048``, as :mod:`course_lib.measure.bench`), and mask patterns from 100% of the score matrix
down to ~10%:

- ``full``; ``causal``; ``window`` (causal sliding window of 40%, 20%, 10% of N);
- ``documents`` (2, 4, 10 documents of random lengths, tokens attend within their document);
- ``random`` block-sparse layouts over 128x128 blocks (50%, 25%, 10% of the blocks kept).

it times forward and forward+backward of the implementations below: the median of
``course_lib.measure.bench``'s timer (``--timer cudagraph``, the default, as the bench grid: the call
replayed in a CUDA graph, so the time is the GPU's alone; ``events``: ``triton.testing.do_bench``,
Python launch overhead included, which at N = 4k is a fair part of a masked call's time) of

- ``course``        ``course_lib.flash_attention`` with the mask as its chapter 10 arguments
  (``window=``, ``block_mask=``): the masked kernels, visited tiles only;
- ``course_dense``  the dense/causal kernels of chapters 06-09 (``full`` and ``causal`` only): the
  yardstick for "time proportional to the visited tiles";
- ``course_varlen`` ``course_lib.flash_attention_varlen`` on the packed documents (``documents``),
  its offsets on the CPU (the API takes them there: it checks them on the host, and with a plan
  kept per packing a repeated call copies nothing, so it can be replayed in a CUDA graph;
  offsets on the GPU cost a device-to-host copy per call);
- ``flex``          ``torch.compile(flex_attention)`` with ``create_block_mask`` of the same mask as
  a ``mask_mod`` (the predicate of each pattern), 128x128 blocks; compiled with dynamic shapes,
  once per mask kind and dtype (``--flex-static`` compiles per N);
- ``fa2_varlen``    ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen, in torch
  since 2.10) on packed sequences: each batch element one sequence (full, causal, windows), or
  the documents as sequences. Where this torch lacks it, or lacks the window argument, the rows
  say ``not run``.

Each row: impl, dtype, d, N, batch, heads, pattern, param, density (fraction of the score matrix
visible), tile_density (fraction of the course's tiles visited), pass, ms, tflops (the FLOPs of
the visible scores, 4·B·H·d·visible forward and 3.5x that for forward+backward, the convention of
:mod:`course_lib.attention.costmodel`). The JSON has the header of ``course_lib/data/benchmarks/h100.json``
(``{"meta": {gpu, driver, torch, triton, date, ...}, "rows": [...]}``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from course_lib.measure.bench import TIMERS, _time_ms, flops, machine_meta, problem_shape  # noqa: E402

D = 128
SEQ_LENS = (4096, 8192, 16384, 32768)
DTYPES = ("float16", "bfloat16")
PASSES = ("fwd", "fwd+bwd")
FLEX_BLOCK = 128  # FlexAttention's default block size; the random layouts use it too
PATTERNS = [("full", None), ("causal", None), ("window", 0.4), ("window", 0.2), ("window", 0.1),
            ("documents", 2), ("documents", 4), ("documents", 10),
            ("random", 0.5), ("random", 0.25), ("random", 0.1)]
QUICK = dict(dtypes=("float16",), seq_lens=(4096, 16384),
             patterns=[("full", None), ("causal", None), ("window", 0.2), ("documents", 4), ("random", 0.25)])
DEFAULT_OUT = ROOT / "course_lib" / "data" / "benchmarks" / "h100_masks.json"


# ----------------------------------------------------------------------------------------------
# FlexAttention's mask functions: one function object per kind, its parameters in tensors, so that
# torch.compile traces each kind once per dtype (a new Python closure per window width or layout
# would recompile flex_attention for every cell, and compiling dominates this benchmark's time).

_PARAMS: dict = {}  # kind -> parameter tensor, set by Pattern before each cell


def _window_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < _PARAMS["window"])


def _document_mod(b, h, q_idx, kv_idx):
    doc = _PARAMS["documents"]
    return doc[q_idx] == doc[kv_idx]


def _random_mod(b, h, q_idx, kv_idx):
    return _PARAMS["random"][q_idx // FLEX_BLOCK, kv_idx // FLEX_BLOCK]


# ----------------------------------------------------------------------------------------------
# The patterns: one object knows its mask for every implementation


class Pattern:
    """One mask on ``(batch, heads, n, n)``: the course's arguments, FlexAttention's mask_mod, the
    FA2 varlen packing, and how much of the score matrix it keeps."""

    def __init__(self, kind, param, batch, heads, n, device, seed=0):
        import torch

        from course_lib.attention import blockmask as bm
        from course_lib.kernels import masked

        self.kind, self.param, self.batch, self.heads, self.n = kind, param, batch, heads, n
        self.device = device
        gen = torch.Generator().manual_seed(seed)
        block_m, block_n = masked.tile_sizes(D, torch.float16)
        self.course_kwargs, self.mask_mod, self.mask_param, self.varlen = {}, None, None, None
        self.dense_kwargs = None  # the chapter 06-09 kernels' call, for full and causal
        lens = None  # sequence lengths of the FA2 varlen packing (None: not comparable)
        if kind == "full":
            self.course_kwargs = dict(block_mask=bm.BlockMask.from_layout(
                torch.ones(math.ceil(n / block_m), math.ceil(n / block_n), dtype=torch.bool), n, n, block_m,
                block_n).to(device))
            self.dense_kwargs = {}
            self.visible = n * n
            lens, self.fa2_window = [n] * batch, (-1, -1)
        elif kind == "causal":
            self.course_kwargs = dict(block_mask=bm.causal_block_mask(n, n, block_m, block_n, device=device))
            self.dense_kwargs = dict(causal=True)
            self.mask_mod = bm.causal_mask_mod
            self.visible = n * (n + 1) // 2
            lens, self.fa2_window = [n] * batch, (-1, 0)
        elif kind == "window":
            w = int(param * n)
            self.course_kwargs = dict(causal=True, window=(w - 1, 0))
            self.mask_mod, self.mask_param = _window_mod, torch.tensor(w, device=device)
            self.visible = sum(min(i + 1, w) for i in range(n))
            lens, self.fa2_window = [n] * batch, (w - 1, 0)
        elif kind == "documents":
            cuts = sorted(torch.randperm(n - 1, generator=gen)[:param - 1].add(1).tolist())
            doc_lens = [b - a for a, b in zip([0] + cuts, cuts + [n])]
            ids = torch.repeat_interleave(torch.arange(param), torch.tensor(doc_lens))
            self.course_kwargs = dict(block_mask=bm.document_block_mask(ids.to(device), block_m, block_n))
            self.mask_mod, self.mask_param = _document_mod, ids.to(device)
            self.visible = sum(x * x for x in doc_lens)
            lens, self.fa2_window = doc_lens * batch, (-1, -1)
        elif kind == "random":
            t = math.ceil(n / FLEX_BLOCK)
            layout = torch.rand(t, t, generator=gen) < param
            layout.fill_diagonal_(True)  # every row sees something
            # the course's tiles (block_m x block_n) cut the same 128x128 blocks finer
            fine = layout.repeat_interleave(FLEX_BLOCK // block_m, 0).repeat_interleave(FLEX_BLOCK // block_n, 1)
            self.course_kwargs = dict(block_mask=bm.BlockMask.from_layout(
                fine[:math.ceil(n / block_m), :math.ceil(n / block_n)], n, n, block_m, block_n).to(device))
            self.mask_mod, self.mask_param = _random_mod, layout.to(device)
            self.visible = int(layout.sum()) * FLEX_BLOCK * FLEX_BLOCK  # n is a multiple of 128 here
        else:
            raise ValueError(f"unknown pattern {kind!r}")
        self.density = self.visible / (n * n)
        if lens is not None:
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
            self.varlen = (cu, max(lens))
        self.tile_density = self._tile_density()

    def _tile_density(self) -> float:
        """Fraction of the course's tiles visited (FULL or PARTIAL) for this mask."""
        import torch

        from course_lib.attention import blockmask as bm
        from course_lib.kernels import masked

        if "block_mask" in self.course_kwargs:
            return self.course_kwargs["block_mask"].density()
        block_m, block_n = masked.tile_sizes(D, torch.float16)
        lo, hi = bm.window_band(self.course_kwargs["window"], self.n, self.n, self.course_kwargs["causal"])
        classes = bm.band_tile_classes(self.n, self.n, block_m, block_n, lo=lo, hi=hi)
        return float((classes != bm.SKIP).float().mean())

    def label(self) -> str:
        if self.kind == "window":
            return f"window {int(self.param * 100)}% of N"
        if self.kind == "documents":
            return f"{self.param} documents"
        if self.kind == "random":
            return f"random {int(self.param * 100)}% blocks"
        return self.kind


# ----------------------------------------------------------------------------------------------
# Implementations: each returns a callable (q, k, v) -> o on (B, H, N, d) tensors, or raises


_FLEX = {}


def _flex_fn(pattern, dynamic: bool):
    """``torch.compile(flex_attention)`` with the pattern's block mask (``create_block_mask`` of
    its mask function, 128x128 blocks). ``dynamic``: compile with symbolic sizes, once for every
    N (the default, to keep compiling under the time budget)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if dynamic not in _FLEX:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    block_mask = None
    if pattern.mask_mod is not None:
        if pattern.mask_param is not None:
            _PARAMS[pattern.kind] = pattern.mask_param
        block_mask = create_block_mask(pattern.mask_mod, None, None, pattern.n, pattern.n,
                                       device=pattern.device, BLOCK_SIZE=FLEX_BLOCK)
    fn = _FLEX[dynamic]
    return lambda q, k, v: fn(q, k, v, block_mask=block_mask)


def _fa2_varlen_fn(pattern):
    """FA2 varlen on the packing of the pattern, or a RuntimeError saying why it cannot run."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as err:
        raise RuntimeError(f"torch.nn.attention.varlen is missing in this torch ({err})") from err
    if pattern.varlen is None:
        raise RuntimeError("no varlen equivalent of this mask")
    params = inspect.signature(varlen_attn).parameters
    cu, max_len = pattern.varlen
    left, right = pattern.fa2_window
    kwargs = {}
    if (left, right) == (-1, 0) and "window_size" not in params:
        kwargs["is_causal"] = True
    elif (left, right) != (-1, -1):
        if "window_size" not in params:
            raise RuntimeError("this torch's varlen_attn has no window_size")
        kwargs["window_size"] = (left, right)

    def run(q, k, v):
        pack = [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]) for x in (q, k, v)]  # (B·N, H, d)
        return varlen_attn(*pack, cu, cu, max_len, max_len, **kwargs)

    return run


def _attention_fn(impl, pattern, flex_dynamic=True):
    from course_lib import flash_attention, flash_attention_varlen

    if impl == "course":
        return lambda q, k, v: flash_attention(q, k, v, **pattern.course_kwargs)
    if impl == "course_dense":
        if pattern.dense_kwargs is None:
            raise RuntimeError("only for full and causal")
        return lambda q, k, v: flash_attention(q, k, v, **pattern.dense_kwargs)
    if impl == "course_varlen":
        if pattern.kind != "documents":
            raise RuntimeError("only for documents")
        cu, max_len = pattern.varlen
        cu_host = cu.cpu()

        def run(q, k, v):
            pack = [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]) for x in (q, k, v)]
            return flash_attention_varlen(*pack, cu_host, cu_host, max_len, max_len)

        return run
    if impl == "flex":
        return _flex_fn(pattern, flex_dynamic)
    if impl == "fa2_varlen":
        return _fa2_varlen_fn(pattern)
    raise ValueError(impl)


IMPLS = ("course", "course_dense", "course_varlen", "flex", "fa2_varlen")
APPLIES = {"course": lambda p: True, "course_dense": lambda p: p.dense_kwargs is not None,
           "course_varlen": lambda p: p.kind == "documents", "flex": lambda p: True,
           "fa2_varlen": lambda p: p.varlen is not None}


def measure(impl, pattern, dtype, pass_, warmup_ms, rep_ms, flex_dynamic=True, timer="cudagraph"):
    """One row, or None (printed: why) if the implementation cannot run this cell."""
    import torch
    import triton

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (pattern.batch, pattern.heads, pattern.n, D)
    needs_grad = pass_ == "fwd+bwd"
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch_dtype, generator=gen).requires_grad_(needs_grad)
               for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch_dtype, generator=gen)
    do_packed = do.transpose(1, 2).reshape(-1, pattern.heads, D)  # the varlen functions' (B·N, H, d)
    try:
        fn = _attention_fn(impl, pattern, flex_dynamic)
        if needs_grad:
            def step():
                o = fn(q, k, v)
                o.backward(do if o.shape == do.shape else do_packed)
        else:
            def step():
                with torch.no_grad():
                    fn(q, k, v)
        step()  # compile, and find out whether it runs at all
        torch.cuda.synchronize()
        grads = [q, k, v] if needs_grad else None
        if timer == "cudagraph":
            ms, timer = _time_ms(step, timer, grads)
        else:
            ms = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads,
                                         return_mode="median")
    except (RuntimeError, TypeError, ValueError, NotImplementedError, torch.OutOfMemoryError) as err:
        print(f"  {impl:13s} {dtype} N={pattern.n} {pattern.label()} {pass_}: not run "
              f"({str(err).splitlines()[0][:100] if str(err) else type(err).__name__})")
        return None
    finally:
        q = k = v = do = do_packed = None  # free the inputs before the next cell
        torch.cuda.empty_cache()
    work = flops(pattern.batch, pattern.heads, pattern.n, D, False, pass_) * pattern.density
    return {"impl": impl, "dtype": dtype, "d": D, "N": pattern.n, "batch": pattern.batch, "heads": pattern.heads,
            "pattern": pattern.kind, "param": pattern.param, "label": pattern.label(),
            "density": round(pattern.density, 4), "tile_density": round(pattern.tile_density, 4),
            "pass": pass_, "ms": round(ms, 4), "tflops": round(work / (ms * 1e-3) / 1e12, 2), "timer": timer}


# ----------------------------------------------------------------------------------------------
# The report


def _cell(rows, impl, **key):
    for r in rows:
        if r["impl"] == impl and all(r[k] == v for k, v in key.items()):
            return r
    return None


def format_table(data: dict, pass_: str) -> str:
    """Per cell: ms of each implementation, course ÷ flex speedup, and the proportionality
    ``course ms / (course_dense full ms × tile density)`` (1.0 = time exactly proportional to the
    visited tiles; ``vis``: the same over the visible fraction of the scores, which also counts
    the masked-out half of each diagonal tile as waste)."""
    rows = [r for r in data["rows"] if r["pass"] == pass_]
    lines = [f"{pass_}: milliseconds (lower is better); x flex = flex ms / course ms; "
             f"prop = course ms / (dense full ms x tile density), vis = the same x visible density",
             f"{'dtype':8s} {'N':>6s} {'pattern':24s} {'dens':>5s} {'tiles':>5s} {'course':>8s} {'dense':>8s} "
             f"{'c.varlen':>8s} {'flex':>8s} {'fa2 vl':>8s} {'x flex':>6s} {'x fa2':>6s} {'prop':>5s} {'vis':>5s}"]
    seen = []
    for r in rows:
        key = (r["dtype"], r["N"], r["label"])
        if key in seen:
            continue
        seen.append(key)
        sel = dict(dtype=r["dtype"], N=r["N"], label=r["label"], **{"pass": pass_})
        ms = {impl: (_cell(rows, impl, **sel) or {}).get("ms") for impl in IMPLS}
        full = _cell(rows, "course_dense", dtype=r["dtype"], N=r["N"], pattern="full", **{"pass": pass_})

        def fmt(x, width=8, digits=3):
            return f"{x:{width}.{digits}f}" if x is not None else f"{'-':>{width}s}"

        x_flex = ms["flex"] / ms["course"] if ms["flex"] and ms["course"] else None
        fast = min([x for x in (ms["course"], ms["course_varlen"]) if x] or [0]) or None
        x_fa2 = ms["fa2_varlen"] / fast if ms["fa2_varlen"] and fast else None
        prop = ms["course"] / (full["ms"] * r["tile_density"]) if full and ms["course"] else None
        vis = ms["course"] / (full["ms"] * r["density"]) if full and ms["course"] else None
        lines.append(f"{r['dtype']:8s} {r['N']:6d} {r['label']:24s} {r['density']:5.2f} {r['tile_density']:5.2f} "
                     f"{fmt(ms['course'])} {fmt(ms['course_dense'])} {fmt(ms['course_varlen'])} {fmt(ms['flex'])} "
                     f"{fmt(ms['fa2_varlen'])} {fmt(x_flex, 6, 2)} {fmt(x_fa2, 6, 2)} {fmt(prop, 5, 2)} {fmt(vis, 5, 2)}")
    return "\n".join(lines)


def summary(data: dict) -> str:
    """Medians of the speedups against FlexAttention and FA2 varlen, per pass."""
    import statistics

    out = []
    for pass_ in PASSES:
        rows = [r for r in data["rows"] if r["pass"] == pass_]
        x_flex, x_fa2 = [], []
        for r in rows:
            if r["impl"] != "flex":
                continue
            sel = dict(dtype=r["dtype"], N=r["N"], label=r["label"], **{"pass": pass_})
            c = _cell(rows, "course", **sel)
            if c:
                x_flex.append(r["ms"] / c["ms"])
        for r in rows:
            if r["impl"] != "fa2_varlen":
                continue
            sel = dict(dtype=r["dtype"], N=r["N"], label=r["label"], **{"pass": pass_})
            ours = [c["ms"] for c in (_cell(rows, "course", **sel), _cell(rows, "course_varlen", **sel)) if c]
            if ours:
                x_fa2.append(r["ms"] / min(ours))
        if x_flex:
            out.append(f"{pass_}: course vs flex median {statistics.median(x_flex):.2f}x "
                       f"(min {min(x_flex):.2f}, max {max(x_flex):.2f}, {len(x_flex)} cells)")
        if x_fa2:
            out.append(f"{pass_}: course vs FA2 varlen median {statistics.median(x_fa2):.2f}x "
                       f"(min {min(x_fa2):.2f}, max {max(x_fa2):.2f}, {len(x_fa2)} cells)")
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fp16, N = 4k and 16k, five patterns (< 1 min)")
    p.add_argument("--dtype", nargs="+", choices=DTYPES)
    p.add_argument("--seq-len", nargs="+", type=int)
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--pattern", nargs="+", choices=sorted({kind for kind, _ in PATTERNS}),
                   help="only these mask kinds (default: all)")
    p.add_argument("--pass", dest="passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--budget-s", type=float, default=430.0,
                   help="stop starting new cells after this many seconds (default 430: the whole run stays "
                        "under 8 minutes)")
    p.add_argument("--flex-static", action="store_true",
                   help="compile flex_attention for each N (dynamic=False): slower to compile")
    p.add_argument("--timer", default="cudagraph", choices=TIMERS,
                   help="cudagraph: GPU time, the call replayed in a CUDA graph (default, as "
                        "course_lib.measure.bench); "
                        "events: triton.testing.do_bench, Python launch overhead included")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)

    import torch

    from course_lib.platform import runtime

    if not torch.cuda.is_available():
        raise SystemExit("bench_masks needs a CUDA GPU")
    runtime.setup(verbose=False)
    dtypes = args.dtype or (QUICK["dtypes"] if args.quick else DTYPES)
    seq_lens = args.seq_len or (QUICK["seq_lens"] if args.quick else SEQ_LENS)
    patterns = QUICK["patterns"] if args.quick else PATTERNS
    if args.pattern:
        patterns = [(kind, param) for kind, param in patterns if kind in args.pattern]
    warmup_ms, rep_ms = (10, 40) if args.quick else (15, 60)
    meta = machine_meta()
    meta.update(tool="tools/bench_masks.py", argv=" ".join(argv if argv is not None else sys.argv[1:]),
                head_dim=D, tokens="batch*N = 16k", model_dim="heads*d = 2048",
                flex=f"torch.compile(flex_attention, dynamic={not args.flex_static}), BLOCK_SIZE={FLEX_BLOCK}",
                timer=args.timer)
    data = {"meta": meta, "rows": [], "skipped": []}
    start = time.perf_counter()

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")

    for dtype in dtypes:  # fp16 first: if the budget runs out, bf16 is what goes
        for n in seq_lens:
            batch, heads = problem_shape(n, D)
            for kind, param in patterns:
                pattern = Pattern(kind, param, batch, heads, n, "cuda")
                for pass_ in args.passes:
                    for impl in args.impl:
                        if not APPLIES[impl](pattern):
                            continue
                        if time.perf_counter() - start > args.budget_s:
                            data["skipped"].append(f"{impl} {dtype} N={n} {pattern.label()} {pass_}")
                            continue
                        row = measure(impl, pattern, dtype, pass_, warmup_ms, rep_ms,
                                      flex_dynamic=not args.flex_static, timer=args.timer)
                        if row:
                            data["rows"].append(row)
                            print(f"  {impl:13s} {dtype} N={n:6d} {pattern.label():24s} {pass_:7s} "
                                  f"{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s", flush=True)
                save()
    data["meta"]["elapsed_s"] = round(time.perf_counter() - start, 1)
    save()
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
          f"{data['meta']['elapsed_s']} s; written to {args.out}")
    if data["skipped"]:
        print(f"budget reached: {len(data['skipped'])} measurements skipped (listed in the JSON)")
    for pass_ in args.passes:
        print()
        print(format_table(data, pass_))
    print()
    print(summary(data))
    return data


if __name__ == "__main__":
    main()
