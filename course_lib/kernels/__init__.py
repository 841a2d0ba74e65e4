"""The Triton FlashAttention kernels (chapters 06 and 07) and their autograd API.

Modules, in the order the chapters teach them:

- :mod:`course_lib.kernels.tuning`   block sizes: one fixed config in the interpreter, an
  autotuned set on the GPU.
- :mod:`course_lib.kernels.forward`  the forward kernel (one Q tile per program, loop over K/V
  tiles, online softmax in registers) and :func:`~course_lib.kernels.forward.attention_forward`.
- :mod:`course_lib.kernels.backward` the backward kernels (D = rowsum(dO∘O); dK/dV; dQ) and
  :func:`~course_lib.kernels.backward.attention_backward`.
- :mod:`course_lib.kernels.api`      input checks, the ``torch.autograd.Function`` and the public
  :func:`~course_lib.kernels.api.flash_attention`.

Importing this package decorates no kernel; the submodules do, after
:func:`course_lib.runtime.ensure_configured` has chosen GPU or interpreter.
"""
