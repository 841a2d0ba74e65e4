"""A small Llama trained on one GPU: tokens/s and peak memory per attention implementation.

Run ``python tools/bench_model.py [--contexts 1024 4096 ...] [--impls ...] [--out FILE]`` on a GPU
(it refuses to run without one). For each context length T (default 1k to 32k) it builds the Llama
of ``course_lib.measure.model_bench.BENCH_SIZE`` (4 layers, hidden 1024, 16 query heads sharing 8 K/V
heads of dimension 64; 8,192-token vocabulary, random weights) in bfloat16 and times AdamW training
steps on random tokens, ``16,384 // T`` sequences a step (16k tokens), with each implementation of
``course_lib.measure.model_bench.IMPLS``:

- ``course_compiled`` / ``course``  the course's kernels (``course_lib.integrations.hf.register()``),
  under ``torch.compile(fullgraph=True)`` / eager;
- ``sdpa_compiled`` / ``sdpa``      ``torch.nn.functional.scaled_dot_product_attention``
  (transformers' "sdpa"), compiled / eager;
- ``eager``                         transformers' "eager" attention: the T × T scores and weights
  materialised, what stops fitting first.

Timer: the wall clock of ``--steps`` steps between two ``torch.cuda.synchronize()`` calls, after
``--warmup`` steps (which include compiling); peak memory: ``torch.cuda.max_memory_allocated``
over the timed steps (weights, AdamW state, activations saved for the backward). A cell that runs
out of memory is recorded as ``oom: true``. The JSON (``course_lib/data/benchmarks/h100_model.json``
by default) carries the provenance chapter 12 prints: GPU, driver, torch, triton, transformers,
date, model, timer. ``--merge`` keeps the rows of an existing file that a run does not measure again,
so the grid can be recorded in shorter runs (e.g. ``--contexts 1024 2048 4096``, then
``--merge --contexts 8192 16384 32768``) on the same machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from course_lib.measure import model_bench  # noqa: E402
from course_lib.measure.bench import machine_meta  # noqa: E402

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def describe_model(size: model_bench.LlamaSize, tokens_per_step: int) -> str:
    """One line naming the model and the batch, for the recorded file's provenance."""
    return (f"Llama, {size.layers} layers, hidden {size.hidden}, {size.heads} heads / "
            f"{size.kv_heads} K/V heads of d = {size.head_dim}, vocabulary "
            f"{model_bench.BENCH_VOCAB:,}, bfloat16, AdamW, {tokens_per_step:,} tokens a step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS),
                        help="context lengths T (default: %(default)s)")
    parser.add_argument("--impls", nargs="+", choices=list(model_bench.IMPLS),
                        default=list(model_bench.IMPLS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling)")
    parser.add_argument("--tokens-per-step", type=int, default=model_bench.BENCH_TOKENS_PER_STEP)
    parser.add_argument("--out", type=Path, default=model_bench.RECORDED_FILE)
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of an existing --out file that this run does not "
                             "measure again (to record the grid in several shorter runs)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("tools/bench_model.py times training on a CUDA GPU; this machine has none "
              "(chapter 12 shows the recorded results in CPU mode)", file=sys.stderr)
        return 2
    for name in ("steps", "warmup", "tokens_per_step"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")

    import transformers

    from course_lib.platform import runtime

    runtime.setup()
    size = model_bench.BENCH_SIZE
    rows = model_bench.measure_grid(args.contexts, args.impls, size=size,
                                    tokens_per_step=args.tokens_per_step, steps=args.steps,
                                    warmup=args.warmup)
    meta = {**machine_meta(), "transformers": transformers.__version__,
            "model": describe_model(size, args.tokens_per_step),
            "timer": (f"{model_bench.timer_note(args.steps, args.warmup)}; peak = "
                      f"torch.cuda.max_memory_allocated over the timed steps"),
            "size": model_bench.size_dict(size)}
    if args.merge and args.out.exists():
        measured = {(row["impl"], row["context"]) for row in rows}
        kept = [row for row in model_bench.validate(json.loads(args.out.read_text()))["rows"]
                if (row["impl"], row["context"]) not in measured]
        rows = kept + rows
    data = model_bench.validate({"meta": meta, "rows": rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    print(model_bench.table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
