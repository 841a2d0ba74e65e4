"""course_lib — the helper library of the course "FlashAttention from scratch".

One concept per module, grouped by layer (ARCHITECTURE.md; README.md maps chapters to modules).
Importing ``course_lib`` decorates no kernel: the public functions below are loaded on first use;
it only lets the module paths from before the layout still import (:mod:`course_lib._moved`). The
one deliberate side effect — choosing Triton's interpreter or the GPU — happens in
:func:`course_lib.platform.runtime.setup` (called by each notebook's first cell, or automatically by the
kernel modules before their first ``@triton.jit``).

Public API (a contract: tests outside the project call these names):

- ``flash_attention(q, k, v, causal=False, scale=None, *, window=None, seq_lens=None,
  block_mask=None)`` — Triton kernel, forward and backward (GQA/MQA when k, v have fewer heads).
- ``flash_attention_with_lse(q, k, v, causal=False, scale=None, *, window=None, seq_lens=None,
  block_mask=None)`` — forward only, ``(o, lse)``.
- ``flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
  causal=False, scale=None, window=None, return_lse=False)`` — packed variable-length batches.
- ``BlockMask`` — which K/V tiles each Q tile visits (:mod:`course_lib.attention.blockmask`).
- ``flash_attention_numpy(q, k, v, causal=False, scale=None, block_m=..., block_n=...)``.
- ``flash_attention_numpy_backward(q, k, v, o, lse, do, causal=False, scale=None, ...)``.
- ``online_softmax(x, block_size)``.

The attention functions (and ``course_lib.kernels.decoding.flash_decode_triton``) work inside
``torch.compile(fullgraph=True)``: their kernels are the ops ``torch.ops.course.*``
(:mod:`course_lib.kernels.ops`).
"""

from importlib import import_module

from course_lib import _moved

_moved.install()  # notebooks saved before the layout keep importing by the old module paths

__version__ = "0.1.0"

# public name -> module that defines it (loaded lazily, so `import course_lib` decorates no kernel)
_PUBLIC = {
    "flash_attention": "course_lib.kernels.api",
    "flash_attention_with_lse": "course_lib.kernels.api",
    "flash_attention_varlen": "course_lib.kernels.api",
    "BlockMask": "course_lib.attention.blockmask",
    "flash_attention_numpy": "course_lib.attention.tiled",
    "flash_attention_numpy_backward": "course_lib.attention.tiled_backward",
    "online_softmax": "course_lib.attention.softmax",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'course_lib' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
