"""The library's kernels as ``torch.library`` ops (namespace ``course``): what ``torch.compile`` sees.

``torch.compile`` cannot trace into a Triton launch that goes through the interpreter, a Gluon
kernel, a tensor descriptor or a config fitted at run time, nor into host code that reads tensor
values (``.tolist()`` of the lengths). So every public entry point reaches its kernels, when
compiling, through one of these ops, which the compiler keeps as a single opaque node: it knows
the op's outputs from the *fake* implementation (shapes, dtypes, strides, no data) and its
gradient from the registered *autograd* formula, which calls the backward op. That is how
flash-attn exposes its kernels, and why ``torch.compile(fullgraph=True)`` keeps one graph around
:func:`course_lib.flash_attention` (chapter 12). The ops, ``torch.ops.course.<name>``:

- ``attention_forward`` / ``attention_backward``: :func:`~course_lib.kernels.api.flash_attention`
  (dense, causal) and ``flash_attention_with_lse``;
- ``masked_attention_forward`` / ``masked_attention_backward``: the same with ``window``,
  ``seq_lens``, ``block_mask`` or GQA (chapter 10's masked kernels);
- ``varlen_attention_forward`` / ``varlen_attention_backward``:
  :func:`~course_lib.kernels.api.flash_attention_varlen`;
- ``flash_decode``: :func:`~course_lib.kernels.decoding.flash_decode_triton` (forward only, as it is
  eagerly).

Forward ops take ``(q, k, v, *rest)`` and return ``(o, lse)``; the backward op of a family takes
``(do, q, k, v, o, lse, *rest)`` with the same ``rest`` and returns ``(dq, dk, dv)``. Op arguments
are tensors, numbers, bools and lists only, so Python objects are taken apart at the boundary:
a window is ``[left, right]``, ``seq_lens`` two optional tensors, a
:class:`~course_lib.attention.blockmask.BlockMask` its tile classes, element mask, document ids and sizes
(:func:`mask_args`), and the op's implementation puts them back together (:func:`mask_from_args`,
cached) and rebuilds its launch plan there (the API's plan caches).

This module holds the ops' *definitions* (schema, fake, autograd) and imports none of the
kernels: the modules that own an implementation register it with :func:`implementation`
(:mod:`course_lib.kernels.api` the attention ops, :mod:`course_lib.kernels.decoding` the decode
op), because they import this module, and an import back would be a cycle. An op runs once the
module holding its implementation is imported (``course_lib.flash_attention`` imports the API).
"""

from __future__ import annotations

import torch

from course_lib.attention import blockmask as bm

NAMESPACE = "course"

# The arguments after (q, k, v) of each differentiable family, shared by its forward and backward
# op. int[]? window: [left, right] or None; block_sizes: [n_q, n_k, block_m, block_n].
_REST = {
    "attention": "bool causal, float scale, bool deterministic",
    "masked_attention": ("bool causal, float scale, int[]? window, Tensor? seq_lens_q, Tensor? seq_lens_k, "
                         "Tensor? block_classes, Tensor? block_element_mask, Tensor? document_ids_q, "
                         "Tensor? document_ids_k, int[]? block_sizes, bool deterministic"),
    "varlen_attention": ("Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
                         "bool causal, float scale, int[]? window, bool deterministic"),
}
_DECODE_SCHEMA = ("(Tensor q, Tensor k, Tensor v, int? splits, float scale, int? block_n, bool? grouped) "
                  "-> (Tensor o, Tensor lse)")


def qualname(name: str) -> str:
    """``"course::<name>"``, the op's name for ``torch.library``."""
    return f"{NAMESPACE}::{name}"


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of ``dtype``: float32, float64 for float64 (as the kernels)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _outputs_fake(q, k, v, *rest):
    """``(o, lse)`` as every forward kernel allocates them: ``o`` contiguous, shaped like q;
    ``lse`` contiguous ``q.shape[:-1]``."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return o, torch.empty(q.shape[:-1], dtype=lse_dtype(q.dtype), device=q.device)


def _gradients_fake(do, q, k, v, o, lse, *rest):
    """``(dq, dk, dv)``: contiguous, shaped like q, k, v (dk, dv have the K/V heads under GQA)."""
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)  # saved for the backward; no entry point differentiates it
    slots = [i for i, x in enumerate(rest) if isinstance(x, torch.Tensor)]
    ctx.save_for_backward(q, k, v, o, lse, *(rest[i] for i in slots))
    ctx.rest, ctx.tensor_slots = [None if i in slots else x for i, x in enumerate(rest)], slots


def _backward_formula(backward_op):
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *saved = ctx.saved_tensors
        rest = list(ctx.rest)
        for i, x in zip(ctx.tensor_slots, saved):
            rest[i] = x
        dq, dk, dv = backward_op(do, q, k, v, o, lse, *rest)
        return (dq, dk, dv, *[None] * len(rest))

    return backward


def _define_ops() -> None:
    for family, rest in _REST.items():
        forward, backward = qualname(f"{family}_forward"), qualname(f"{family}_backward")
        torch.library.define(forward, f"(Tensor q, Tensor k, Tensor v, {rest}) -> (Tensor o, Tensor lse)")
        torch.library.define(backward, f"(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
                                       f"{rest}) -> (Tensor dq, Tensor dk, Tensor dv)")
        torch.library.register_fake(forward, _outputs_fake)
        torch.library.register_fake(backward, _gradients_fake)
        torch.library.register_autograd(forward, _backward_formula(getattr(torch.ops.course, f"{family}_backward")),
                                        setup_context=_setup_context)
    torch.library.define(qualname("flash_decode"), _DECODE_SCHEMA)
    torch.library.register_fake(qualname("flash_decode"), _outputs_fake)


_define_ops()

attention_forward = torch.ops.course.attention_forward.default
attention_backward = torch.ops.course.attention_backward.default
masked_attention_forward = torch.ops.course.masked_attention_forward.default
masked_attention_backward = torch.ops.course.masked_attention_backward.default
varlen_attention_forward = torch.ops.course.varlen_attention_forward.default
varlen_attention_backward = torch.ops.course.varlen_attention_backward.default
flash_decode = torch.ops.course.flash_decode.default
ALL_OPS = (attention_forward, attention_backward, masked_attention_forward, masked_attention_backward,
           varlen_attention_forward, varlen_attention_backward, flash_decode)


def implementation(name: str):
    """Decorator: the decorated function runs op ``course::<name>`` on CPU (interpreter) and CUDA tensors.

    Args:
        name: the op, e.g. ``"attention_forward"``; the function takes the op's arguments in order.

    Returns:
        The decorator, which returns the function unchanged (the eager path calls it directly).
    """
    def register(fn):
        torch.library.register_kernel(qualname(name), ("cpu", "cuda"), fn)
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# The masked family's Python objects at the op boundary


def mask_args(window, seq_lens, block_mask) -> tuple:
    """Take a masked call's checked ``window``, ``seq_lens`` and ``block_mask`` apart into op arguments.

    Args:
        window: ``(left, right)`` or None; seq_lens: None, a ``(B,)`` tensor or a pair of them;
        block_mask: a :class:`~course_lib.attention.blockmask.BlockMask` whose element rules (causal,
            window, seq_lens) the caller has already merged into the other arguments, or None.

    Returns:
        ``(window, seq_lens_q, seq_lens_k, block_classes, block_element_mask, document_ids_q,
        document_ids_k, block_sizes)``, the masked ops' arguments after ``scale`` (``seq_lens_k``
        None: the same lengths as the queries).
    """
    window = None if window is None else list(window)
    if isinstance(seq_lens, (tuple, list)):
        lens_q, lens_k = seq_lens
    else:
        lens_q, lens_k = seq_lens, None
    if block_mask is None:
        return window, lens_q, lens_k, None, None, None, None, None
    doc_q, doc_k = block_mask.document_ids if block_mask.document_ids is not None else (None, None)
    sizes = [block_mask.n_q, block_mask.n_k, block_mask.block_m, block_mask.block_n]
    return window, lens_q, lens_k, block_mask.classes, block_mask.mask, doc_q, doc_k, sizes


def mask_from_args(window, seq_lens_q, seq_lens_k, block_classes, block_element_mask, document_ids_q,
                   document_ids_k, block_sizes):
    """Inverse of :func:`mask_args`: ``(window, seq_lens, block_mask)`` for the API's plan builders.

    The :class:`~course_lib.attention.blockmask.BlockMask` is rebuilt once per set of tensors (its tile
    lists are computed in the constructor) and kept, so that a compiled call that passes the same
    block mask's tensors again finds it, with the launch plans and device copies the API keeps
    inside it.
    """
    window = None if window is None else tuple(window)
    seq_lens = seq_lens_q if seq_lens_k is None else (seq_lens_q, seq_lens_k)
    if block_classes is None:
        return window, seq_lens, None
    parts = (block_classes, block_element_mask, document_ids_q, document_ids_k)
    # Keyed by where the tensors' data live, not by the Python objects: the backward op gets the
    # tensors autograd saved, new objects over the same memory. An entry holds its tensors, so that
    # memory cannot be freed and reused by other data while the entry lives (a block mask's tensors
    # are read-only by contract).
    key = (*(_memory(x) for x in parts), tuple(block_sizes))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        return window, seq_lens, hit[1]
    docs = None if document_ids_q is None else (document_ids_q, document_ids_k)
    block_mask = bm.BlockMask(block_classes, *block_sizes, mask=block_element_mask, document_ids=docs)
    if len(_BLOCK_MASKS) >= _BLOCK_MASK_CACHE_SIZE:
        _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
    _BLOCK_MASKS[key] = (parts, block_mask)
    return window, seq_lens, block_mask


def _memory(x: torch.Tensor | None):
    return None if x is None else (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)


_BLOCK_MASKS: dict = {}
# Block masks kept at once: a model uses a few (one per layer pattern); each entry holds its
# tensors (an element mask is B·H·N² bytes), so the oldest goes first.
_BLOCK_MASK_CACHE_SIZE = 16
