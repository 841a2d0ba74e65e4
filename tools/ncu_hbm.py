"""Measure real DRAM traffic of naive attention and of the course's forward kernel (Nsight Compute).

On the GPU machine:
    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv --target-processes all \
        python3 tools/ncu_hbm.py naive   > naive.csv
    ncu ... python3 tools/ncu_hbm.py flash > flash.csv
Then ``python tools/ncu_hbm.py --summarize naive.csv flash.csv`` sums the bytes per run and sets
them beside chapter 04's model (course_lib.attention.iomodel), which counts every tile load as HBM
traffic (no cache between SRAM and HBM).

Setting: one forward pass, batch 1, 16 heads, N = 4096, d = 64, fp16, non-causal; the forward
kernel is launched with the fixed GPU config (COURSE_LIB_AUTOTUNE=0) so its tile sizes are known.
"""

from __future__ import annotations

import csv
import os
import sys

HEADS, N, D = 16, 4096, 64
ELEMENT_BYTES = 2  # fp16


def run(which: str) -> None:
    os.environ["COURSE_LIB_AUTOTUNE"] = "0"
    from course_lib.platform import runtime

    rt = runtime.setup()
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, N, D, device="cuda", dtype=torch.float16, generator=gen)
               for _ in range(3))
    if which == "naive":
        s = (q @ k.transpose(-1, -2)) * D ** -0.5  # (1, H, N, N) written to HBM
        p = torch.softmax(s, dim=-1)  # read N×N, write N×N
        o = p @ v  # read N×N
    else:
        from course_lib.kernels.forward import attention_forward

        o, _ = attention_forward(q, k, v, False, D ** -0.5)
    torch.cuda.synchronize()
    print(f"{which}: done, o{tuple(o.shape)}", file=sys.stderr)


def summarize(paths: list[str]) -> None:
    from course_lib.attention import costmodel, iomodel
    from course_lib.kernels import tuning

    blocks = tuning.gpu_default("forward", D, ELEMENT_BYTES)
    steps = costmodel.step_costs(N, D, "float16", heads=HEADS)
    model = {
        "naive": sum(steps[name].bytes for name in ("qk", "softmax", "pv")),
        "flash": iomodel.fa2_io(N, N, D, blocks.block_m, blocks.block_n, batch=HEADS).bytes("float16"),
    }
    compulsory = 4 * HEADS * N * D * ELEMENT_BYTES  # read q, k, v once; write o once
    print(f"H=16, N={N}, d={D}, fp16; flash tiles BLOCK_M={blocks.block_m}, BLOCK_N={blocks.block_n}")
    print(f"{'run':>6} {'kernels':>8} {'DRAM read MB':>13} {'DRAM write MB':>14} {'total MB':>9} "
          f"{'model MB':>9} {'compulsory MB':>14}")
    for path in paths:
        which = "naive" if "naive" in os.path.basename(path) else "flash"
        read = write = 0.0
        kernels = set()
        with open(path) as fh:
            lines = [line for line in fh if line.startswith('"')]
        for row in csv.DictReader(lines):
            if "distribution_" in row["Kernel Name"]:
                continue  # torch.randn filling q, k, v: set-up, not attention
            value = float(row["Metric Value"].replace(",", ""))
            scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}[row["Metric Unit"]]
            kernels.add(row["ID"])
            if row["Metric Name"] == "dram__bytes_read.sum":
                read += value * scale
            elif row["Metric Name"] == "dram__bytes_write.sum":
                write += value * scale
        print(f"{which:>6} {len(kernels):>8} {read / 1e6:>13.1f} {write / 1e6:>14.1f} "
              f"{(read + write) / 1e6:>9.1f} {model[which] / 1e6:>9.1f} {compulsory / 1e6:>14.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "--summarize":
        summarize(sys.argv[2:])
    else:
        run(sys.argv[1])
