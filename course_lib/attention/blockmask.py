"""Tile-level block masks for the masked Triton kernels (chapter 10), in FlexAttention's spirit.

Chapter 04 sorts every ``(Q tile, K/V tile)`` pair into SKIP (nothing visible: never loaded),
PARTIAL (computed with an element mask) or FULL (computed without one); chapter 08 does it in
NumPy for sliding windows and block-sparse layouts (:mod:`course_lib.attention.masks`, whose ``SKIP``,
``PARTIAL``, ``FULL`` codes this module uses). A kernel wants the same information as *lists*:
for each Q tile, which K/V tiles to visit, and of those which need the element mask. That is what
PyTorch's FlexAttention ``BlockMask`` stores, and what :class:`BlockMask` stores here:

- ``full_kv_num_blocks[b, h, i]``, ``full_kv_indices[b, h, i, :]``: the FULL K/V tiles of Q tile
  ``i`` (the first ``full_kv_num_blocks`` entries of the row are meaningful);
- ``kv_num_blocks``, ``kv_indices``: its PARTIAL K/V tiles (FlexAttention's naming: "kv" alone
  means the tiles that need the mask);
- ``full_q_*``, ``q_*``: the same lists transposed (which Q tiles see each K/V tile), for the
  dK/dV kernel of the backward.

All lists are int32 tensors. The leading ``(b, h)`` dims are ``(B or 1, H or 1)``: 1 means the
mask is the same for every batch element / head.

Which elements count. Key columns past the keys (the padding of a ragged last K/V tile, or keys
past a sample's length) count as *hidden*, so a tile holding any of them is never FULL: the
kernel must mask them. Query rows past the queries (the ragged last Q tile, or rows past a
sample's length, whose outputs the kernel sets to zero anyway) count as neither visible nor
hidden. With that convention, a builder's tile is SKIP exactly when none of its elements is
visible and FULL exactly when all are.

Builders:

- :meth:`BlockMask.from_mask_mod` — any predicate ``mask_mod(b, h, q_idx, kv_idx)`` (the
  signature FlexAttention's ``create_block_mask`` takes), evaluated on every element: exact
  classes, and the dense element mask is kept for the kernel's partial tiles;
- :func:`causal_block_mask`, :func:`sliding_window_block_mask`, :func:`length_block_mask` —
  from indices alone (:func:`band_tile_classes`), no element mask needed;
- :func:`document_block_mask` — documents packed one after another; the kernel compares document
  ids on partial tiles;
- :meth:`BlockMask.from_layout` — a ``(T_q, T_k)`` boolean block-sparse layout.

The mask functions :func:`causal_mask_mod`, :func:`sliding_window_mask_mod`,
:func:`document_mask_mod`, :func:`length_mask_mod` are FlexAttention-style predicates for the same
patterns (FlexAttention's ``create_block_mask`` takes them as they are).
"""

from __future__ import annotations

import math
from numbers import Integral

import torch

from course_lib.attention.masks import FULL, PARTIAL, SKIP

__all__ = [
    "SKIP", "PARTIAL", "FULL", "BlockMask", "band_tile_classes", "combine_classes",
    "causal_block_mask", "sliding_window_block_mask", "length_block_mask", "document_block_mask",
    "causal_mask_mod", "sliding_window_mask_mod", "document_mask_mod", "length_mask_mod",
    "and_masks", "validate_window", "MIN_TILE", "MAX_TILE",
]

MIN_TILE, MAX_TILE = 16, 256  # tl.dot needs >= 16 rows; larger tiles do not fit on chip
# "Unbounded" for the window arithmetic: larger than any sequence the 32-bit kernels accept.
UNBOUNDED = 2**30


def _int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _tile_size(name: str, value) -> int:
    value = _int(name, value)
    if value & (value - 1) or not MIN_TILE <= value <= MAX_TILE:
        raise ValueError(f"{name} must be a power of two between {MIN_TILE} and {MAX_TILE} (the kernels' "
                         f"tile sizes), got {value}")
    return value


def validate_window(window) -> tuple[int, int]:
    """``(left, right)`` as ints, each ``>= -1`` (-1: unbounded on that side), else an error naming
    ``window``."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}")
    left, right = window
    for side, x in (("left", left), ("right", right)):
        if isinstance(x, bool) or not isinstance(x, Integral):
            raise TypeError(f"window must be a pair (left, right) of ints, got {side} = {x!r}")
        if x < -1:
            raise ValueError(f"window sizes must be >= -1 (-1 = unbounded), got window {side} = {x}")
    return int(left), int(right)


def _lists(classes: torch.Tensor, cls: int):
    """``(num, indices)`` int32: how many tiles of class ``cls`` each row of ``classes`` has, and
    their column indices in increasing order (first ``num`` entries of each row)."""
    chosen = classes == cls
    num = chosen.sum(-1, dtype=torch.int32)
    order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num.contiguous(), order.contiguous()


class BlockMask:
    """Which K/V tiles each Q tile visits, and which of those are partial.

    Args:
        classes: ``(B or 1, H or 1, T_q, T_k)`` integer tensor of SKIP / PARTIAL / FULL
            (a 2-D ``(T_q, T_k)`` grid is taken as ``(1, 1, T_q, T_k)``).
        n_q, n_k: the sequence lengths it was built for; ``T_q = cdiv(n_q, block_m)``,
            ``T_k = cdiv(n_k, block_n)``.
        block_m, block_n: tile sizes (powers of two, 16 to 256); the kernels run with them.
        mask: optional boolean ``(B or 1, H or 1, n_q, n_k)`` element mask, applied on PARTIAL
            tiles only (True = visible);
        document_ids: optional ``(doc_q, doc_k)``, int tensors ``(B or 1, n_q)`` and
            ``(B or 1, n_k)``: on PARTIAL tiles query ``i`` sees key ``j`` only when their ids agree.
        causal, window, seq_lens: element rules computed from indices on PARTIAL tiles, with the
            meaning of :func:`course_lib.kernels.api.flash_attention`'s arguments of the same names
            (the builders below set them); the API applies them as if they had been passed to it.

    The element mask of a PARTIAL tile is the AND of all the rules given and the bound of the keys;
    a BlockMask with none of them makes every key of a PARTIAL tile visible.
    """

    def __init__(self, classes, n_q: int, n_k: int, block_m: int, block_n: int, *, mask=None,
                 document_ids=None, causal: bool = False, window=None, seq_lens=None):
        self.n_q, self.n_k = _int("n_q", n_q), _int("n_k", n_k)
        self.block_m, self.block_n = _tile_size("block_m", block_m), _tile_size("block_n", block_n)
        if not isinstance(classes, torch.Tensor):
            classes = torch.as_tensor(classes)
        if classes.dim() == 2:
            classes = classes[None, None]
        expected = (math.ceil(self.n_q / self.block_m), math.ceil(self.n_k / self.block_n))
        if classes.dim() != 4 or tuple(classes.shape[-2:]) != expected:
            raise ValueError(f"classes must have shape (B or 1, H or 1, T_q, T_k) with (T_q, T_k) = {expected} "
                             f"tiles for n_q={self.n_q}, n_k={self.n_k}, tiles {self.block_m}x{self.block_n}; "
                             f"got {tuple(classes.shape)}")
        if classes.is_floating_point() or classes.dtype == torch.bool:
            raise TypeError(f"classes must be an integer tensor of SKIP/PARTIAL/FULL, got {classes.dtype}")
        self.classes = classes.to(torch.int8)
        if mask is not None:
            mask = torch.as_tensor(mask, device=self.classes.device)
            if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (self.n_q, self.n_k):
                raise ValueError(f"mask must be a boolean (B or 1, H or 1, n_q, n_k) tensor with "
                                 f"(n_q, n_k) = {(self.n_q, self.n_k)}, got {mask.dtype} {tuple(mask.shape)}")
        self.mask = mask
        if document_ids is not None:
            doc_q, doc_k = document_ids
            if doc_q.dim() != 2 or doc_k.dim() != 2 or doc_q.shape[-1] != self.n_q or doc_k.shape[-1] != self.n_k:
                raise ValueError(f"document_ids must be (doc_q, doc_k) of shapes (B or 1, n_q={self.n_q}) and "
                                 f"(B or 1, n_k={self.n_k}), got {tuple(doc_q.shape)} and {tuple(doc_k.shape)}")
            document_ids = (doc_q.to(torch.int32).contiguous(), doc_k.to(torch.int32).contiguous())
        self.document_ids = document_ids
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        self.causal = causal
        self.window = None if window is None else validate_window(window)
        self.seq_lens = None if seq_lens is None else tuple(seq_lens)
        self.full_kv_num_blocks, self.full_kv_indices = _lists(self.classes, FULL)
        self.kv_num_blocks, self.kv_indices = _lists(self.classes, PARTIAL)
        transposed = self.classes.transpose(-1, -2)
        self.full_q_num_blocks, self.full_q_indices = _lists(transposed, FULL)
        self.q_num_blocks, self.q_indices = _lists(transposed, PARTIAL)

    # -- shape and counts ------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B or 1, H or 1, T_q, T_k)``."""
        return tuple(self.classes.shape)

    @property
    def block_size(self) -> tuple[int, int]:
        return self.block_m, self.block_n

    @property
    def device(self) -> torch.device:
        return self.classes.device

    def counts(self) -> dict[str, int]:
        """``{"skipped", "partial", "full", "total"}`` tile counts over all ``(b, h)``."""
        c = self.classes
        return {"skipped": int((c == SKIP).sum()), "partial": int((c == PARTIAL).sum()),
                "full": int((c == FULL).sum()), "total": c.numel()}

    def density(self) -> float:
        """Fraction of the tiles the kernel visits (FULL or PARTIAL)."""
        return float((self.classes != SKIP).float().mean())

    def __repr__(self) -> str:
        c = self.counts()
        return (f"BlockMask(shape={self.shape}, tiles {self.block_m}x{self.block_n}, n_q={self.n_q}, "
                f"n_k={self.n_k}, full={c['full']}, partial={c['partial']}, skipped={c['skipped']})")

    def to(self, device) -> "BlockMask":
        doc = None if self.document_ids is None else tuple(x.to(device) for x in self.document_ids)
        lens = None if self.seq_lens is None else tuple(x.to(device) for x in self.seq_lens)
        return BlockMask(self.classes.to(device), self.n_q, self.n_k, self.block_m, self.block_n,
                         mask=None if self.mask is None else self.mask.to(device), document_ids=doc,
                         causal=self.causal, window=self.window, seq_lens=lens)

    # -- builders ----------------------------------------------------------------------------------

    @classmethod
    def from_mask_mod(cls, mask_mod, B: int | None, H: int | None, n_q: int, n_k: int,
                      block_m: int, block_n: int, device=None) -> "BlockMask":
        """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` on every element (broadcast index tensors of
        shapes ``(B,1,1,1)``, ``(1,H,1,1)``, ``(1,1,n_q,1)``, ``(1,1,1,n_k)``; ``B``/``H`` None = 1:
        the same for all) and classify the tiles exactly. Keeps the ``(B, H, n_q, n_k)`` boolean
        mask for the partial tiles: memory ``B·H·n_q·n_k`` bytes, fine for teaching sizes; use the
        dedicated builders for long sequences."""
        n_q, n_k = _int("n_q", n_q), _int("n_k", n_k)
        block_m, block_n = _tile_size("block_m", block_m), _tile_size("block_n", block_n)
        nb, nh = _int("B", B) if B is not None else 1, _int("H", H) if H is not None else 1
        b = torch.arange(nb, device=device)[:, None, None, None]
        h = torch.arange(nh, device=device)[None, :, None, None]
        qi = torch.arange(n_q, device=device)[None, None, :, None]
        kj = torch.arange(n_k, device=device)[None, None, None, :]
        mask = torch.as_tensor(mask_mod(b, h, qi, kj), device=device)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask_mod must return booleans, got {mask.dtype}")
        mask = mask.expand(nb, nh, n_q, n_k).contiguous()
        return cls(_classes_of_mask(mask, block_m, block_n), n_q, n_k, block_m, block_n, mask=mask)

    @classmethod
    def from_layout(cls, layout, n_q: int, n_k: int, block_m: int, block_n: int) -> "BlockMask":
        """A boolean block-sparse layout ``(T_q, T_k)`` or ``(B or 1, H or 1, T_q, T_k)``: True tiles
        are visible entirely (FULL; PARTIAL for a ragged last K/V tile, whose padding the kernel
        masks), False tiles SKIP."""
        layout = torch.as_tensor(layout)
        if layout.dtype != torch.bool:
            raise TypeError(f"layout must be a boolean tensor, got {layout.dtype}")
        classes = torch.where(layout, FULL, SKIP).to(torch.int8)
        if classes.dim() == 2:
            classes = classes[None, None]
        if n_k % block_n and classes.shape[-1] == math.ceil(n_k / block_n):
            last = classes[..., -1]
            classes[..., -1] = torch.where(last == FULL, PARTIAL, last).to(torch.int8)
        return cls(classes, n_q, n_k, block_m, block_n)


def _classes_of_mask(mask: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """Exact tile classes of a boolean ``(B, H, n_q, n_k)`` mask under the module's convention:
    padding columns hidden, padding rows ignored."""
    nb, nh, n_q, n_k = mask.shape
    t_q, t_k = math.ceil(n_q / block_m), math.ceil(n_k / block_n)

    def padded(row_pad: bool):
        x = torch.zeros((nb, nh, t_q * block_m, t_k * block_n), dtype=torch.bool, device=mask.device)
        x[:, :, n_q:, :] = row_pad
        x[:, :, :n_q, :n_k] = mask
        return x.reshape(nb, nh, t_q, block_m, t_k, block_n)

    any_visible = padded(False).any(dim=5).any(dim=3)
    all_visible = padded(True).all(dim=5).all(dim=3)
    return torch.where(all_visible, FULL, torch.where(any_visible, PARTIAL, SKIP)).to(torch.int8)


def _per_batch(x, device) -> torch.Tensor:
    """An int or a 1-D int tensor as an int64 column ``(B, 1, 1)`` for tile arithmetic."""
    return torch.as_tensor(x, device=device, dtype=torch.int64).reshape(-1, 1, 1)


def band_tile_classes(n_q: int, n_k: int, block_m: int, block_n: int, *, lo=None, hi=None,
                      len_q=None, len_k=None, device=None) -> torch.Tensor:
    """Tile classes, from indices alone, of the band ``i + lo <= j <= i + hi`` within lengths.

    Query ``i`` (``< len_q``) sees key ``j`` (``< len_k``) when ``i + lo <= j <= i + hi``. ``lo``,
    ``hi`` (None: unbounded), ``len_q``, ``len_k`` (None: ``n_q``, ``n_k``) are ints or ``(B,)``
    tensors, one per sample. Causal, sliding windows and per-sample lengths are all such bands,
    and any combination of them is one. Returns ``(B or 1, 1, T_q, T_k)`` int8.

    A tile covers real rows ``r0..r1`` (``r1 < len_q``) and columns ``c0..c1`` (all of them,
    ``c1 = c0 + block_n - 1``; those ``>= len_k`` are hidden). Both band edges rise with ``i``, so

    * something is visible when some row ``i`` in ``[max(r0, c0 - hi), min(r1, c1' - lo)]`` exists
      (``c1' = min(c1, len_k - 1)``);
    * everything is visible when ``c1 < len_k``, ``c0 >= r1 + lo`` (the last row's left edge) and
      ``c1 <= r0 + hi`` (the first row's right edge).
    """
    t_q, t_k = math.ceil(n_q / block_m), math.ceil(n_k / block_n)
    lo = _per_batch(-UNBOUNDED if lo is None else lo, device)
    hi = _per_batch(UNBOUNDED if hi is None else hi, device)
    len_q = _per_batch(n_q if len_q is None else len_q, device)
    len_k = _per_batch(n_k if len_k is None else len_k, device)
    r0 = torch.arange(t_q, device=device, dtype=torch.int64)[None, :, None] * block_m  # (1, T_q, 1)
    c0 = torch.arange(t_k, device=device, dtype=torch.int64)[None, None, :] * block_n  # (1, 1, T_k)
    r1 = torch.minimum(r0 + block_m, len_q) - 1
    c1 = c0 + block_n - 1
    c1_real = torch.minimum(c1, len_k - 1)
    some = ((r0 < len_q) & (c0 < len_k)
            & (torch.maximum(r0, c0 - hi) <= torch.minimum(r1, c1_real - lo)))
    every = (r0 < len_q) & (c1 < len_k) & (c0 >= r1 + lo) & (c1 <= r0 + hi)
    classes = torch.where(every, FULL, torch.where(some, PARTIAL, SKIP)).to(torch.int8)
    return classes[:, None]  # (B or 1, 1, T_q, T_k)


def combine_classes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Tile classes of the intersection of two masks, conservatively: SKIP if either is SKIP,
    FULL if both are FULL, PARTIAL otherwise (broadcast over the leading dims)."""
    return torch.where((a == SKIP) | (b == SKIP), SKIP,
                       torch.where((a == FULL) & (b == FULL), FULL, PARTIAL)).to(torch.int8)


def window_band(window, n_q, n_k, causal: bool = False, bottom_right_causal: bool = False):
    """``(lo, hi)`` offsets (None = unbounded) of the band: FlashAttention-2's window
    ``(left, right)`` aligned to the bottom-right corner (offset ``n_k - n_q``), and the causal mask
    (top-left ``j <= i``, or bottom-right ``j <= i + n_k - n_q``). ``n_q``, ``n_k`` are ints or
    per-sample tensors."""
    lo = hi = None
    off = n_k - n_q
    if window is not None:
        left, right = validate_window(window)
        lo = None if left < 0 else off - left
        hi = None if right < 0 else off + right
    if causal:
        c = off if bottom_right_causal else 0
        if hi is None:
            hi = c
        elif isinstance(hi, torch.Tensor) or isinstance(c, torch.Tensor):
            hi = torch.minimum(torch.as_tensor(hi), torch.as_tensor(c))
        else:
            hi = min(hi, c)
    return lo, hi


def causal_block_mask(n_q: int, n_k: int, block_m: int, block_n: int, device=None) -> BlockMask:
    """Causal, top-left aligned (query ``i`` sees keys ``j <= i``, as SDPA's ``is_causal``)."""
    n_q, n_k = _int("n_q", n_q), _int("n_k", n_k)
    return BlockMask(band_tile_classes(n_q, n_k, block_m, block_n, hi=0, device=device),
                     n_q, n_k, block_m, block_n, causal=True)


def sliding_window_block_mask(n_q: int, n_k: int, window, block_m: int, block_n: int,
                              causal: bool = False, device=None) -> BlockMask:
    """FlashAttention-2's sliding window ``(left, right)``: query ``i`` sees keys
    ``i + n_k - n_q - left <= j <= i + n_k - n_q + right`` (-1: unbounded), and ``j <= i`` too when
    ``causal`` (top-left, as the library's ``causal``)."""
    n_q, n_k = _int("n_q", n_q), _int("n_k", n_k)
    lo, hi = window_band(window, n_q, n_k, causal)
    return BlockMask(band_tile_classes(n_q, n_k, block_m, block_n, lo=lo, hi=hi, device=device),
                     n_q, n_k, block_m, block_n, causal=causal, window=window)


def length_block_mask(seq_lens_q, seq_lens_k, n_q: int, n_k: int, block_m: int, block_n: int,
                      causal: bool = False) -> BlockMask:
    """Padded batch: sample ``b`` has ``seq_lens_q[b]`` real queries and ``seq_lens_k[b]`` real keys
    (``(B,)`` int tensors); keys past the length are hidden, Q tiles past it visit nothing.
    ``causal``: top-left within each sample."""
    n_q, n_k = _int("n_q", n_q), _int("n_k", n_k)
    classes = band_tile_classes(n_q, n_k, block_m, block_n, hi=0 if causal else None, len_q=seq_lens_q,
                                len_k=seq_lens_k, device=seq_lens_q.device)
    return BlockMask(classes, n_q, n_k, block_m, block_n, causal=causal, seq_lens=(seq_lens_q, seq_lens_k))


def _check_document_ids(name: str, ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (N,) or (B, N), got {type(ids).__name__} "
                        f"{getattr(ids, 'dtype', '')}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (N,) or (B, N), got {tuple(ids.shape)}")
    if ids.shape[-1] > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
        raise ValueError(f"{name} must be non-decreasing along the sequence (documents packed one after "
                         f"another)")
    return ids


def _id_ranges(ids: torch.Tensor, block: int, pad_for_min, pad_for_max):
    """Smallest and largest id of each tile of ``block`` positions ``(B, T)``."""
    nb, n = ids.shape
    t = math.ceil(n / block)
    lo = torch.full((nb, t * block), pad_for_min, dtype=torch.int64, device=ids.device)
    hi = torch.full((nb, t * block), pad_for_max, dtype=torch.int64, device=ids.device)
    lo[:, :n] = ids
    hi[:, :n] = ids
    return lo.reshape(nb, t, block).amin(-1), hi.reshape(nb, t, block).amax(-1)


def document_block_mask(document_ids, block_m: int, block_n: int, document_ids_k=None,
                        causal: bool = False) -> BlockMask:
    """Documents packed one after another: query ``i`` sees key ``j`` only inside its own document.

    ``document_ids``: ``(N,)`` or ``(B, N)`` non-decreasing ints, the document of each query (and of
    each key, unless ``document_ids_k`` gives the keys' own). A tile is SKIP when its rows' and its
    columns' id ranges do not overlap, FULL when all its rows and columns are one document (and all
    its columns are real keys), else PARTIAL; exact when queries and keys share the ids. The kernel
    compares ids on the partial tiles. ``causal``: also ``j <= i`` (top-left).
    """
    doc_q = _check_document_ids("document_ids", document_ids)
    doc_k = doc_q if document_ids_k is None else _check_document_ids("document_ids_k", document_ids_k)
    block_m, block_n = _tile_size("block_m", block_m), _tile_size("block_n", block_n)
    n_q, n_k = doc_q.shape[-1], doc_k.shape[-1]
    big = 2**62
    # Padding rows are ignored (min over real rows only); padding columns are hidden (never FULL).
    rq_lo, rq_hi = _id_ranges(doc_q, block_m, big, -big)
    ck_lo, ck_hi = _id_ranges(doc_k, block_n, big, -big)
    rq_lo, rq_hi = rq_lo[:, :, None], rq_hi[:, :, None]
    ck_lo, ck_hi = ck_lo[:, None, :], ck_hi[:, None, :]
    some = (rq_hi >= ck_lo) & (ck_hi >= rq_lo)
    ragged_col = torch.zeros(ck_lo.shape[-1], dtype=torch.bool, device=doc_q.device)
    if n_k % block_n:
        ragged_col[-1] = True
    every = (rq_lo == rq_hi) & (ck_lo == ck_hi) & (rq_lo == ck_lo) & ~ragged_col
    classes = torch.where(every, FULL, torch.where(some, PARTIAL, SKIP)).to(torch.int8)[:, None]
    if causal:
        classes = combine_classes(classes, band_tile_classes(n_q, n_k, block_m, block_n, hi=0,
                                                             device=doc_q.device))
    return BlockMask(classes, n_q, n_k, block_m, block_n, document_ids=(doc_q, doc_k), causal=causal)


# ----------------------------------------------------------------------------------------------
# FlexAttention-style mask functions: mask_mod(b, h, q_idx, kv_idx) -> bool


def causal_mask_mod(b, h, q_idx, kv_idx):
    """Top-left causal: key ``j <= i``."""
    return q_idx >= kv_idx


def sliding_window_mask_mod(window, n_q: int, n_k: int):
    """FlashAttention-2's window ``(left, right)``, bottom-right aligned (offset ``n_k - n_q``)."""
    left, right = validate_window(window)
    off = n_k - n_q

    def mask_mod(b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx - off
        ok = rel == rel  # all True, same shape as the indices
        if left >= 0:
            ok = ok & (rel >= -left)
        if right >= 0:
            ok = ok & (rel <= right)
        return ok

    return mask_mod


def document_mask_mod(document_ids, document_ids_k=None):
    """Same document: ``document_ids[b, i] == document_ids_k[b, j]`` (ids ``(N,)`` or ``(B, N)``)."""
    doc_q = _check_document_ids("document_ids", document_ids)
    doc_k = doc_q if document_ids_k is None else _check_document_ids("document_ids_k", document_ids_k)

    def mask_mod(b, h, q_idx, kv_idx):
        bq = b if doc_q.shape[0] > 1 else torch.zeros_like(b)
        bk = b if doc_k.shape[0] > 1 else torch.zeros_like(b)
        return doc_q[bq, q_idx] == doc_k[bk, kv_idx]

    return mask_mod


def length_mask_mod(seq_lens_q, seq_lens_k):
    """Padded batch: query ``i < seq_lens_q[b]`` and key ``j < seq_lens_k[b]``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx < seq_lens_q[b]) & (kv_idx < seq_lens_k[b])

    return mask_mod


def and_masks(*mask_mods):
    """The intersection of several mask functions."""

    def mask_mod(b, h, q_idx, kv_idx):
        ok = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            ok = ok & m(b, h, q_idx, kv_idx)
        return ok

    return mask_mod
