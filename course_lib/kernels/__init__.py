"""The Triton and Gluon kernels (chapters 05 to 12), with one dispatch on top.

The dispatch is :mod:`~course_lib.kernels.api` (the public entry points, their autograd Functions
and the ``torch.library`` op implementations) with its launch plans (:mod:`~course_lib.kernels.plan`);
no kernel module imports either (``tests/test_import_cycles.py``). Below the kernels: the helpers
they share (``tiles``, ``tuning``, ``fit``, ``launch``, ``compat``, ``inputs``, the op declarations
``ops``). Modules, in the order the chapters teach them:

- :mod:`course_lib.kernels.primer`   chapter 05's primer kernels (vector add, fused row softmax, tiled
  matmul).
- :mod:`course_lib.kernels.tiles`    the ``@triton.jit`` tile helpers every kernel shares:
  program → (batch, head, tile), tile pointers and masked loads, which tiles need a mask, the
  online-softmax step; the constants as ``tl.constexpr``.
- :mod:`course_lib.kernels.teaching` chapter 06's teaching kernel, built from the pieces the
  learner writes, and its launcher :func:`~course_lib.kernels.teaching.forward`.
- :mod:`course_lib.kernels.tuning`   block sizes: one fixed config in the interpreter, a table
  measured on an H100 for the GPU (autotuning is opt-in).
- :mod:`course_lib.kernels.forward`  the forward kernel (one Q tile per program, loop over K/V
  tiles, online softmax in registers) and :func:`~course_lib.kernels.forward.attention_forward`.
- :mod:`course_lib.kernels.backward` the backward kernels (delta = rowsum(dO∘O), the paper's D;
  dK/dV; dQ) and :func:`~course_lib.kernels.backward.attention_backward`.
- :mod:`course_lib.kernels.hopper`   chapter 09: the forward with tensor-descriptor (TMA) loads,
  used by the library on Hopper at head dim 128, and the FP8 (e4m3) forward.
- :mod:`course_lib.kernels.decoding` chapter 08: split-KV flash-decoding with GQA/MQA.
- :mod:`course_lib.kernels.masked`   chapter 10: masks as tile lists (block-sparse, sliding
  window, documents, per-sample and packed variable lengths, GQA), forward and backward.
- :mod:`course_lib.kernels.gluon_hopper`, :mod:`~course_lib.kernels.gluon_backward`,
  :mod:`~course_lib.kernels.gluon_masked`   chapters 09-10 on Hopper, in Gluon.
- :mod:`course_lib.kernels.inputs`   the argument checks and views the launchers share.
- :mod:`course_lib.kernels.api`      input checks, the ``torch.autograd.Function`` and the public
  :func:`~course_lib.kernels.api.flash_attention` (and ``flash_attention_varlen``); it chooses the
  kernel of each call (with :mod:`~course_lib.kernels.plan`).

Importing this package decorates no kernel; the submodules do, after
:func:`course_lib.platform.runtime.ensure_configured` has chosen GPU or interpreter.
"""
