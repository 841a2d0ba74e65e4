import nbformat
from nbformat.v4 import new_notebook, new_markdown_cell as md, new_code_cell as code

cells = [
md("""# 00 — Setup and roadmap

Make sure your machine can run every chapter, learn how exercises and checks work, and see where the course goes.

**You will learn**
- which of the two modes you are in: **GPU** (Triton kernels compiled for your CUDA GPU) or **CPU** (Triton's interpreter running the same kernels on CPU tensors);
- how to confirm that Triton really computes (and not silently returns zeros);
- how an exercise cell, its check and the three outcomes — *passed*, *not done yet*, *wrong* — work;
- the map of the chapters ahead."""),
md("""## Which mode am I in?

Every notebook starts with the same cell. `runtime.setup()` looks for a CUDA GPU. Without one it switches Triton into its
**interpreter** *before* any kernel is defined (Triton decides how to run a kernel when `@triton.jit` decorates it), so the
very same kernel code runs on CPU tensors — slowly, so the notebooks then use small sizes. It prints one line."""),
code("""from course_lib import runtime
rt = runtime.setup()   # prints one line: GPU or CPU (Triton interpreter) mode"""),
md("""## The environment report

The versions below are the ones the course pins (`pyproject.toml`). On the GPU machine the report also shows the GPU's memory and
number of streaming multiprocessors (SMs) — numbers chapter 02 uses."""),
code("""# NBVAL_IGNORE_OUTPUT
from course_lib.envcheck import environment_report

for key, value in environment_report().items():
    print(f"{key:>16}: {value}")"""),
md("""## Does Triton really compute?

Some combinations of Triton, NumPy and PyTorch versions have been seen to launch a kernel without error and leave the output
untouched. The smoke test fills the output with NaN first ("poisons" it), runs a tiny kernel `out = 2x + 1` on 1,000 elements
(not a multiple of the 128-element block, so the masked tail is exercised), and compares every element with NumPy. You will write
kernels like this one yourself in chapter 05."""),
code("""# NBVAL_CHECK_OUTPUT
from course_lib.envcheck import triton_smoke_test

err = triton_smoke_test()
print("Triton smoke test passed" if err < 1e-5 else "Triton smoke test FAILED")"""),
md("""## How exercises work

An exercise is a code cell that names itself (`# Exercise 0.1: ...`) with a function for you to complete. In your copy the body is
`raise NotImplementedError(...)`. The **next cell checks it** and rebinds the name to what the rest of the notebook should use:

| outcome | what you see | what happens next |
|---|---|---|
| passed | one line with ✓ | the notebook uses *your* function |
| not done yet | one line with … | the notebook goes on with the library's implementation, so later cells still run |
| wrong | a red diagnosis: exercise id, inputs' shapes, max error, first bad element, and the likely cause when the check recognises the mistake | the notebook stops at that cell until you fix it |

**Exercise 0.1 (warm-up).** Attention starts by comparing every query with every key. Given `q` of shape `(N_q, d)` and `k` of shape
`(N_k, d)`, return the scaled scores $S = q k^\\top / \\sqrt{d}$, shape `(N_q, N_k)`. Use NumPy (`@` is matrix product, `.T` transposes)."""),
code("""import numpy as np

# Exercise 0.1: scaled dot-product scores q kᵀ / sqrt(d)
def scaled_scores(q, k):
    \"\"\"q: (N_q, d), k: (N_k, d) -> (N_q, N_k) scores scaled by 1/sqrt(d).\"\"\"
    ### BEGIN SOLUTION
    d = q.shape[-1]
    return (q @ k.T) / np.sqrt(d)
    ### END SOLUTION"""),
code("""from course_lib.exercises import ch00

scaled_scores = ch00.check_scaled_scores(scaled_scores)"""),
md("""### What a wrong answer looks like

Checks try your function on several inputs with awkward sizes and compare it with a reference. When it is wrong they say *how*.
Here is the diagnosis for a classic slip — dividing by $d$ instead of $\\sqrt{d}$ (we catch the error so this notebook keeps running;
in your own exercise cells the diagnosis simply appears in red):"""),
code("""# NBVAL_CHECK_OUTPUT
from course_lib.checks import ExerciseFailed

def scaled_scores_wrong(q, k):
    return (q @ k.T) / q.shape[-1]

try:
    ch00.check_scaled_scores(scaled_scores_wrong)
except ExerciseFailed as failure:
    print(failure)"""),
md("""## The road ahead

| # | chapter | you build | you can play with |
|---|---|---|---|
| 01 | naive attention | `softmax(QKᵀ/√d)V` in NumPy and PyTorch; the memory of the N×N matrix | memory-vs-N slider |
| 02 | the memory wall | FLOPs, bytes and arithmetic intensity of each step; the roofline | intensity calculator, roofline |
| 03 | online softmax | safe → online softmax → merging partial states | tile-by-tile stepper |
| 04 | tiled attention in NumPy | the FlashAttention forward with explicit tiles (FA1 and FA2 loop orders), an exact HBM-traffic counter | tiling simulator |
| 05 | Triton primer | programs, blocks, masks; vector add and a fused row softmax | — |
| 06 | FlashAttention forward in Triton | the real kernel: online softmax in registers, ragged N, causal tile skipping, exp2 | benchmark plots |
| 07 | the backward pass | the gradient derivation, NumPy tiled backward, Triton backward kernels, autograd, a tiny language model | — |
| 08 | beyond | KV cache and flash-decoding, GQA/MQA, sliding-window and block-sparse masks | KV-cache calculator |

Each chapter imports what the earlier ones built from `course_lib`, so you can start anywhere after this one."""),
md("""## Summary

- `runtime.setup()` picks GPU or interpreter mode and prints it; on CPU the sizes are small.
- The smoke test proves Triton writes correct values on this machine.
- Exercises: fill in the function, run the check; *not done yet* never blocks you, *wrong* tells you why.

**Going further:** read `README.md` for the two commands (`make lab`, `make test`) and how the notebooks are tested."""),
]
nb = new_notebook(cells=cells)
nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
nb.metadata["language_info"] = {"name": "python"}
nbformat.write(nb, "/work/main/solutions/00_setup_and_roadmap.ipynb")
