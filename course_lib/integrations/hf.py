"""The course's kernels as a Hugging Face transformers attention implementation (chapter 12).

::

    from course_lib.integrations import hf
    hf.register()                                   # registers "course"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="course")
    model.set_attn_implementation("course")         # or switch a model that exists

transformers (5.17 to 5.23) calls an attention implementation as
``fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs)`` with
``query`` ``(B, H, N_q, d)`` and ``key``/``value`` ``(B, H_kv, N_k, d)`` (the KV cache already
appended), and expects ``(out, weights)`` with ``out`` ``(B, N_q, H, d)``. Before the layers run,
the model asks the *mask function* registered under the same name what ``attention_mask`` to
pass; without one it passes none, and the causal mask and the padding are silently lost. So
:func:`register` registers two functions:

- :func:`padding_mask` (``AttentionMaskInterface``): FlashAttention-2's answer,
  ``transformers.masking_utils.flash_attention_mask``: the 2-D padding mask ``(B, L)`` (bool,
  True = a real token), or None when no token is padding; never a dense ``N_q × N_k`` mask. It
  first checks that the pattern asked for is one the kernels serve (causal, or causal with a
  sliding window) and refuses any other; with a static cache it also says how many of the cache's
  slots are written (``L`` shorter than ``N_k``).
- the attention function, which picks a kernel for each call (causal is aligned bottom-right
  throughout: the queries are the last ``N_q`` of the ``N_k`` positions):

  - no padding, ``N_q = N_k`` (a prompt, a training step): ``flash_attention(causal=True)``;
  - no padding, ``N_q <= 16`` new tokens against a longer cache, every row seeing the whole cache
    (one new token of ``model.generate``), no gradient wanted: the flash-decoding kernels,
    ``kernels.decoding.flash_decode_triton`` (split-KV, GQA by index);
  - no padding, any other ``N_q < N_k`` (several new tokens, or a sliding window that cuts keys
    off): ``flash_attention(window=(left, 0))``, FlashAttention-2's bottom-right window (``left =
    -1``: unbounded); ``flash_attention(causal=True)`` would be top-left, as SDPA's;
  - padding (left or right): the real tokens gathered (as transformers' ``_upad_input`` does for
    FlashAttention-2) into ``flash_attention_varlen``, causal bottom-right per sequence; the output
    is 0 at padding queries.

Supported: causal attention; padding on either side (any 0/1 pattern of the 2-D mask, since the
real tokens keep their order); GQA/MQA (``key``/``value`` with fewer heads go to the kernels as
they are, no ``repeat_kv``); a sliding window from the ``sliding_window`` the attention module
passes (Mistral's for every layer, Qwen2's for the layers its config makes sliding): the token and the
``sliding_window - 1`` before it, ``window=(sliding_window - 1, 0)``; ``scaling`` from the module;
``is_causal=False`` without a mask; the default dynamic KV cache, the sliding-window cache and the
static cache (its unwritten slots are cut off); gradients through every path except flash-decoding
(taken only when no gradient is wanted, as under ``model.generate``).

Refused with ``NotImplementedError`` naming the feature and the argument (never a silent wrong
answer): ``output_attentions=True`` (the kernels never form the weights); softcapping
(``softcap``, ``config.attn_logit_softcapping``); attention dropout (``dropout > 0``, i.e.
``config.attention_dropout`` in training mode); attention sinks (``s_aux``, ``sinks``); a position
bias; padding-free packed batches (``cu_seq_lens_q``/``cu_seq_lens_k``, or ``position_ids`` that
restart); any 4-D, float or block mask; a non-causal call with a mask or a window; masks other than
causal and sliding-window causal (bidirectional, chunked, image-token or block overlays); a sliding
window over a padding mask with holes inside a sequence (padding only at the ends is fine).

``attention`` (a learner's kernel, chapter 12): ``attention(q, k, v, causal, scale) -> o`` on
``(B, H, N, d)`` tensors, ``k``/``v`` possibly with fewer heads, ``causal`` top-left as in
``course_lib.flash_attention``. It is called with ``causal=True`` when ``N_q = N_k`` and
``causal=False`` for one new token against the cache (that token sees every cached key); padded
batches are unpadded one sequence at a time (``N_q = N_k`` again, or one token). What it cannot express
(a sliding window; several new tokens against a longer cache) is refused, and an output of the wrong
shape or dtype is an error naming ``attention``.
"""

from __future__ import annotations

import re

import torch

try:
    from transformers import AttentionInterface
    from transformers import masking_utils
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:  # the course pins transformers; a bare install of course_lib may lack it
    raise ImportError("course_lib.integrations.hf needs Hugging Face transformers: "
                      "pip install transformers (pyproject.toml pins the tested version)") from err

from course_lib.attention.reference import default_scale

__all__ = ["DEFAULT_NAME", "register", "attention_forward", "padding_mask"]

DEFAULT_NAME = "course"
# transformers reads "org/name" as a kernel on the Hub and "paged|name" as a paged variant: a name
# of letters, digits, "_" and "-" is only ever looked up in the registries.
_NAME_RE = re.compile(r"[A-Za-z0-9_\-]+")
# What the registered functions carry, so that register() may replace its own but never
# transformers' built-in implementations ("sdpa", "flash_attention_2", ...).
_MARK = "_course_lib_hf"
# Where the message sends a user whose model needs what the course refuses.
_ELSEWHERE = "use attn_implementation='sdpa' (or 'eager') for this model or call"

# kwargs that change what attention computes, and what each one is. transformers passes every
# other kwarg along too (position_ids, use_cache, ...): those do not change the attention.
_REFUSED_KWARGS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "a position bias added to the scores",
    "cu_seq_lens_q": "padding-free packed batches",
    "cu_seq_lens_k": "padding-free packed batches",
    "max_length_q": "padding-free packed batches",
    "max_length_k": "padding-free packed batches",
}

# The mask patterns transformers may ask the mask function for, recognised by their code (the
# functions are closures made per call): the plain causal one and Mistral's sliding window,
# and_masks(sliding_window_overlay(w), causal_mask_function).
_SLIDING_EXAMPLE = masking_utils.sliding_window_causal_mask_function(1)


def _closure(fn) -> dict:
    """A closure's free variables by name ({} for a plain function)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _is_served_pattern(mask_function) -> bool:
    """True for ``causal_mask_function`` and ``sliding_window_causal_mask_function(w)``."""
    if mask_function is masking_utils.causal_mask_function:
        return True
    if getattr(mask_function, "__code__", None) is not _SLIDING_EXAMPLE.__code__:
        return False
    parts = _closure(mask_function).get("mask_functions", ())
    overlay = _closure(_SLIDING_EXAMPLE)["mask_functions"][0]
    return (len(parts) == 2 and parts[1] is masking_utils.causal_mask_function
            and getattr(parts[0], "__code__", None) is overlay.__code__)


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """The mask function registered for the course: the 2-D padding mask, or None.

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset: as transformers passes them.
        mask_function: the pattern transformers asks for; only the causal and the sliding-window
            causal ones are served (the window itself reaches the attention function as
            ``sliding_window``, as for FlashAttention-2).
        attention_mask: the model's 2-D padding mask ``(B, seen + q_length)`` or None.

    Returns:
        ``(B, kv_length)`` bool (True = a real token; fewer columns with a static cache) or None
        when nothing is padding.
    """
    if not _is_served_pattern(mask_function):
        name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
        raise NotImplementedError(
            f"course attention: the model asks for a mask made by {name} (packed sequences from "
            f"position_ids, bidirectional or chunked attention, or an image/block overlay); the course "
            f"serves causal and sliding-window causal masks with padding only: {_ELSEWHERE}")
    mask = masking_utils.flash_attention_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    # A static cache hands the attention all its slots, the unwritten ones too (kv_length is its size):
    # only the first q_offset + q_length - kv_offset exist. FlashAttention-2's mask says so (by being
    # shorter than kv_length) only when the model was given a 2-D mask; say it here in the other case.
    written = int(q_offset) + q_length - int(kv_offset)
    if mask is None and written < kv_length:
        mask = torch.ones((batch_size, written), dtype=torch.bool, device=kwargs.get("device"))
    return mask


def _refuse_unsupported(module, attention_mask, dropout, is_causal, sliding_window, kwargs) -> None:
    """Raise NotImplementedError naming what the course's kernels do not compute (ValueError for a
    malformed ``sliding_window``)."""
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        raise NotImplementedError(f"course attention: output_attentions=True is not supported (the kernels "
                                  f"never form the attention weights): {_ELSEWHERE}")
    for name, value in (("softcap", kwargs.get("softcap")),
                        ("config.attn_logit_softcapping", getattr(config, "attn_logit_softcapping", None))):
        if value is not None:
            raise NotImplementedError(f"course attention: logit softcapping ({name}={value!r}) is not "
                                      f"supported: {_ELSEWHERE}")
    if dropout:
        raise NotImplementedError(f"course attention: attention dropout (dropout={dropout!r}, from "
                                  f"config.attention_dropout in training mode) is not supported: set "
                                  f"attention_dropout=0 or {_ELSEWHERE}")
    for name, feature in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"course attention: {feature} ({name}=...) is not supported: {_ELSEWHERE}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise NotImplementedError(f"course attention: an attention_mask of type "
                                      f"{type(attention_mask).__name__} is not supported (the course takes "
                                      f"the 2-D padding mask its mask function returns): {_ELSEWHERE}")
        if attention_mask.dim() != 2:
            raise NotImplementedError(
                f"course attention: a {attention_mask.dim()}-D attention_mask {tuple(attention_mask.shape)} "
                f"(a custom mask given to the model) is not supported; the course takes causal + padding, "
                f"as the 2-D mask (B, N_k): {_ELSEWHERE}")
        if attention_mask.is_floating_point():
            raise NotImplementedError(f"course attention: a float (additive) attention_mask is not supported; "
                                      f"the 2-D padding mask is bool or 0/1 integers: {_ELSEWHERE}")
        if not is_causal:
            raise NotImplementedError(f"course attention: a non-causal call (is_causal=False) with an "
                                      f"attention_mask is not supported: {_ELSEWHERE}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"course attention: sliding_window must be a positive int or None, got "
                             f"{sliding_window!r}")
        if not is_causal:
            raise NotImplementedError(f"course attention: a sliding window (sliding_window={sliding_window}) "
                                      f"on a non-causal call (is_causal=False) is not supported: {_ELSEWHERE}")


def _window_left(sliding_window, n_k: int):
    """Keys before the diagonal a query sees (transformers' window: the token and the
    ``sliding_window - 1`` before it), or None when the window cuts nothing off."""
    if sliding_window is None or n_k <= sliding_window:
        return None
    return sliding_window - 1


def _decoding_applies(q, k, v, causal: bool, left) -> bool:
    """True when the flash-decoding kernels compute this call exactly: a few queries against a
    longer cache, every query row seeing every key, and no gradient wanted (they have no backward)."""
    n_q, n_k = q.shape[2], k.shape[2]
    if n_q >= n_k:  # a prefill or training step: decided before the decoding kernels are imported
        return False
    from course_lib.kernels import decoding as kdec
    from course_lib.kernels.api import KERNEL_DTYPES

    return (n_q <= kdec.MAX_DECODE_QUERIES and q.dtype in KERNEL_DTYPES
            and (n_q == 1 or not causal)  # one causal query at the end sees every key
            and left is None  # the window cuts nothing off (see _window_left)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


def _library_attend(q, k, v, causal: bool, left, scale: float) -> torch.Tensor:
    """The library's kernels on unpadded ``(B, H, N, d)`` inputs; causal is bottom-right aligned."""
    n_q, n_k = q.shape[2], k.shape[2]
    if _decoding_applies(q, k, v, causal, left):
        from course_lib.kernels import decoding as kdec

        return kdec.flash_decode_triton(q, k, v, scale=scale)[0]
    from course_lib.kernels import api  # decorates the kernels on first use only

    if left is None and (not causal or n_q == n_k):
        return api.flash_attention(q, k, v, causal=causal, scale=scale)
    # FlashAttention-2's window is aligned to the bottom-right corner: (left, 0) is causal (left = -1:
    # unbounded) for queries that are the last N_q of the N_k positions.
    return api.flash_attention(q, k, v, scale=scale, window=(-1 if left is None else left, 0))


def _learner_attend(attention, q, k, v, causal: bool, left, scale: float) -> torch.Tensor:
    """A learner's ``attention(q, k, v, causal, scale)`` (top-left causal) where it computes the call
    exactly: ``N_q = N_k``, or one new token (or a non-causal call) that sees every key."""
    n_q, n_k = q.shape[2], k.shape[2]
    if left is not None:
        raise NotImplementedError(f"course attention: a sliding window (keys {left} back) needs the library's "
                                  f"kernels (window=); a learner's attention(q, k, v, causal, scale) has no "
                                  f"window: register without attention= for this model")
    if causal and n_q not in (1, n_k):
        raise NotImplementedError(f"course attention: {n_q} queries against {n_k} keys need causal attention "
                                  f"aligned bottom-right, which a learner's attention(q, k, v, causal, scale) "
                                  f"(top-left) cannot express: register without attention= for this call")
    o = attention(q, k, v, causal and n_q == n_k, scale)
    if not isinstance(o, torch.Tensor) or o.shape != q.shape:
        got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
        raise ValueError(f"attention must return o shaped like q, (B, H, N_q, d) = {tuple(q.shape)}, got {got}")
    if o.dtype != q.dtype:
        raise TypeError(f"attention must return o in q's dtype {q.dtype}, got {o.dtype}")
    return o


def _attend(attention, q, k, v, causal: bool, left, scale: float) -> torch.Tensor:
    """Unpadded ``(B, H, N, d)`` inputs -> ``(B, N_q, H, d)``."""
    if attention is None:
        o = _library_attend(q, k, v, causal, left, scale)
    else:
        o = _learner_attend(attention, q, k, v, causal, left, scale)
    return o.transpose(1, 2)


def _token_indices(mask: torch.Tensor, device) -> torch.Tensor:
    """Positions of the real tokens in the flattened ``(B · N)`` token axis, ``(total,)`` int64."""
    return mask.flatten().nonzero().squeeze(1).to(device)


def _gather(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, d)`` -> ``(total, H, d)``: the tokens at ``indices`` of the flattened ``B · N`` axis."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).index_select(0, indices)


def _scatter(packed: torch.Tensor, indices: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """``(total, H, d)`` -> ``(B, N, H, d)`` with zeros at the padding positions (differentiable)."""
    out = packed.new_zeros((batch * n, *packed.shape[1:]))
    return out.index_copy(0, indices, packed).view(batch, n, *packed.shape[1:])


def _one_run_per_row(mask: torch.Tensor) -> bool:
    """True when each row's real tokens are contiguous (padding only at the ends)."""
    starts = torch.diff(mask.to(torch.int8), dim=1, prepend=torch.zeros_like(mask[:, :1], dtype=torch.int8))
    return bool(((starts == 1).sum(1) <= 1).all())


def _attend_padded(attention, q, k, v, mask: torch.Tensor, causal: bool, left, scale: float) -> torch.Tensor:
    """``(B, H, N, d)`` inputs with a 2-D padding mask ``(B, L)`` over the keys -> ``(B, N_q, H, d)``.

    The queries are the last ``N_q`` of the ``L`` positions (the cache, then the new tokens); their
    padding is ``mask[:, -N_q:]``. Real tokens keep their order, so causal attention between them,
    aligned bottom-right per sequence, is the padded causal mask restricted to real tokens.
    """
    batch, _, n_q, _ = q.shape
    host = mask.to("cpu", torch.bool)  # lengths are read on the host (the varlen API checks them there)
    host_q = host[:, -n_q:]
    if left is not None and not _one_run_per_row(host):
        raise NotImplementedError("course attention: a sliding window over a padding mask with holes inside a "
                                  "sequence is not supported (the window would count padding positions): "
                                  f"pad at the ends only, or {_ELSEWHERE}")
    idx_q, idx_k = _token_indices(host_q, q.device), _token_indices(host, q.device)
    if idx_q.numel() == 0:  # every query is padding
        return q.new_zeros((batch, n_q, q.shape[1], v.shape[-1]))
    if attention is None:
        from course_lib.kernels import api  # decorates the kernels on first use only

        lens_q, lens_k = host_q.sum(1, dtype=torch.int32), host.sum(1, dtype=torch.int32)
        cu_q, cu_k = (torch.nn.functional.pad(x.cumsum(0, dtype=torch.int32), (1, 0)) for x in (lens_q, lens_k))
        o = api.flash_attention_varlen(
            _gather(q, idx_q), _gather(k, idx_k), _gather(v, idx_k), cu_q, cu_k, int(lens_q.max()),
            max(int(lens_k.max()), 1), causal=causal, scale=scale, window=None if left is None else (left, 0))
        return _scatter(o, idx_q, batch, n_q)
    # a learner's kernel: one sequence at a time, its real tokens only
    parts, where = [], []
    for b in range(batch):
        rows_q, rows_k = host_q[b].nonzero().squeeze(1), host[b].nonzero().squeeze(1)
        if rows_q.numel() == 0:
            continue
        rows_q, rows_k = rows_q.to(q.device), rows_k.to(q.device)
        sample = [x[b:b + 1].index_select(2, rows) for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        parts.append(_attend(attention, *sample, causal, left, scale)[0])  # (n_q of sequence b, H, d)
        where.append(rows_q + b * n_q)
    return _scatter(torch.cat(parts), torch.cat(where), batch, n_q)


def _forward(attention, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
             sliding_window=None, **kwargs):
    """The attention function registered by :func:`register` (see :func:`attention_forward`)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    _refuse_unsupported(module, attention_mask, dropout, causal, sliding_window, kwargs)
    batch, _, n_q, _ = query.shape
    if attention_mask is not None:
        if attention_mask.shape[0] != batch or not n_q <= attention_mask.shape[1] <= key.shape[2]:
            raise ValueError(f"attention_mask must have shape (B, L) with B = {batch} and N_q = {n_q} <= L <= "
                             f"N_k = {key.shape[2]}, got {tuple(attention_mask.shape)}")
        # keys past the mask's last column are a static cache's unwritten slots
        key, value = key[:, :, :attention_mask.shape[1]], value[:, :, :attention_mask.shape[1]]
        if bool(attention_mask.all()):  # nothing is padding: the unpadded kernels (and flash-decoding) serve
            attention_mask = None
    n_k = key.shape[2]
    if n_q > n_k:
        raise ValueError(f"course attention: query has N_q = {n_q} positions, more than key's N_k = {n_k}; "
                         f"a decoder's queries are the last N_q of its keys")
    scale = default_scale(query.shape[-1]) if scaling is None else float(scaling)
    left = _window_left(sliding_window, n_k)
    if attention_mask is None:
        out = _attend(attention, query, key, value, causal, left, scale)
    else:
        out = _attend_padded(attention, query, key, value, attention_mask, causal, left, scale)
    return out.contiguous(), None


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, sliding_window=None, attention=None, **kwargs):
    """The course's kernels called as transformers calls an attention implementation.

    Args:
        module: the attention layer (its ``is_causal`` and ``config`` are read).
        query: ``(B, H, N_q, d)``; key, value: ``(B, H_kv, N_k, d)``, ``H_kv`` dividing ``H``.
        attention_mask: None or the 2-D padding mask ``(B, L)`` of :func:`padding_mask`.
        dropout: must be 0. scaling: score scale (default ``1/sqrt(d)``).
        is_causal: default ``module.is_causal`` (True for decoders).
        sliding_window: transformers' window (the token and ``sliding_window - 1`` before it) or None.
        attention: None (the library's kernels) or a learner's ``attention(q, k, v, causal, scale)``.
        kwargs: the rest of what transformers passes; those that change attention are refused.

    Returns:
        ``(out, None)``: ``out`` ``(B, N_q, H, d)`` contiguous, 0 at padding queries.
    """
    return _forward(attention, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    is_causal=is_causal, sliding_window=sliding_window, **kwargs)


def register(name: str = DEFAULT_NAME, attention=None) -> str:
    """Register the course's attention (and its mask function) with transformers under ``name``.

    Args:
        name: the ``attn_implementation`` to use: letters, digits, ``_`` and ``-``; not one of
            transformers' own ("sdpa", "eager", "flash_attention_2", ...). Registering a name again
            replaces the course's earlier registration.
        attention: None (the library's kernels, ``course_lib.flash_attention`` and friends) or a
            callable ``attention(q, k, v, causal, scale) -> o`` on ``(B, H, N, d)`` tensors (k, v may
            have fewer heads), causal top-left: a learner's kernel.

    Returns:
        ``name``, for ``from_config(cfg, attn_implementation=...)`` or ``model.set_attn_implementation``.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"name must be a non-empty string of letters, digits, '_' and '-', got {name!r}")
    if attention is not None and not callable(attention):
        raise TypeError(f"attention must be None or a callable attention(q, k, v, causal, scale), got "
                        f"{type(attention).__name__}")
    for registry in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
        taken = registry.get(name)
        if taken is not None and not getattr(taken, _MARK, False):
            raise ValueError(f"name {name!r} is transformers' own attention implementation; choose another name")

    def course_attention(module, query, key, value, attention_mask, **kwargs):
        return _forward(attention, module, query, key, value, attention_mask, **kwargs)

    setattr(course_attention, _MARK, True)
    AttentionInterface.register(name, course_attention)
    AttentionMaskInterface.register(name, padding_mask)
    return name


setattr(padding_mask, _MARK, True)
