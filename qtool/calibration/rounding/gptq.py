"""GPTQ (Frantar et al., 2022): integer codes for a Linear weight, chosen column by column with the inverse-Hessian
error feedback, on a grid that is already fixed.

Input: the weight ``W`` ``(out, in)``, the layer-input Hessian ``H = sum(x xᵀ)`` ``(in, in)`` over the calibration
tokens, and the encoding the analyzer chose (per-element ``scale``/``offset`` expanded from any granularity:
per-tensor, per-channel or blocks along the input). Output: codes in ``[qmin, qmax]``, as ``quantize`` gives
them, so ``dequantize(codes)`` is the layer's quantized weight and every exporter writes them unchanged.

The grid is the analyzer's and is never re-chosen while columns are updated (GPTQ's "static groups"): the scales
in every file are the ones calibration reported, and act-order needs no group bookkeeping. With ``H`` a multiple
of the identity no column feeds error to another, and the codes are exactly round-to-nearest.

Steps, for columns in order (or by decreasing ``H_jj`` with ``act_order``), in blocks of ``block_columns``:
``H += dampening * mean(diag H) * I``; ``U = chol(H⁻¹)ᵀ`` (upper); for column ``j``: ``q_j = Q(w_j)``,
``e_j = (w_j - dequant(q_j)) / U_jj``, ``w_k -= e_j U_jk`` for the later columns ``k`` of its sub-block of 32;
after a sub-block the rest of its block, and after a block the later blocks, take its errors at once (one
matmul: the paper's lazy batch, on two levels). Columns whose input is always zero
(``H_jj = 0``) keep round-to-nearest and feed nothing forward. Last, each output row keeps GPTQ's codes or
round-to-nearest, whichever gives the smaller output error on the calibration inputs (``d H dᵀ``): GPTQ is
greedy, and on small layers a row can come out worse. So a layer's output error is never above RTN's.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ...quant.affine import blocked_shapes, dequantize, quantize, resolve_block_size
from ...quant.floatgrid import FloatElement
from ...quant.ggml import IQ4_TABLE, GgmlType
from ..graphs import enabled_by_environment, record

Grid = Union[FloatElement, GgmlType]  # a grid other than AIMET's integers
# columns whose errors reach each other one by one inside a block of ``block_columns``; the rest of the block
# takes a sub-block's errors in one matmul (the same sums in another order: measured on SmolLM2's layers, one
# code in 1.8M differs, and the column loop is ~1.5x faster on wide layers)
_SUB_BLOCK = 32
# False (or QTOOL_CUDA_GRAPHS=0): the column loop launches each step itself (bench/gptq_columns.py compares the two)
CUDA_GRAPHS = enabled_by_environment()
_ROW_CHUNK_VALUES = 1 << 21  # the row check's float64 work a chunk of rows at a time (16 MB per temporary)

__all__ = ["gptq_codes", "expand_encoding", "as_problems", "keep_better_rows"]


def expand_encoding(t: torch.Tensor, weight_shape: Sequence[int], block_size: Optional[Sequence[int]]) -> torch.Tensor:
    """An encoding tensor (scale or offset, in the encoding's shape) expanded to one value per weight element."""
    t = torch.as_tensor(t)
    if t.dim() == 0:
        return t.expand(tuple(weight_shape)).contiguous()
    x_view, enc_view, _ = blocked_shapes(weight_shape, t.shape, block_size)
    return t.reshape(enc_view).expand(x_view).reshape(tuple(weight_shape)).contiguous()


@torch.no_grad()
def gptq_codes(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
               qmin: int, qmax: int, block_size: Optional[Sequence[int]] = None, *, block_columns: int = 128,
               dampening: float = 0.01, act_order: bool = True, bounded: bool = False, shrinkage: float = 0.0,
               element: Optional[Grid] = None, notes: Optional[List[str]] = None) -> torch.Tensor:
    """GPTQ codes (int64, the weight's shape) for ``weight`` ``(out, in)`` on the grid ``scale``/``offset`` (in the
    encoding's shape with ``block_size``, as :func:`qtool.quant.affine.quantize` takes them).

    ``hessian`` ``(in, in)`` is ``sum(x xᵀ)`` over the layer's inputs (any positive multiple gives the same codes
    up to float rounding). Computed in float32 on the weight's device; ``block_columns`` only trades speed for
    memory; ``dampening`` is the fraction of the mean diagonal added to it; ``act_order`` visits columns by
    decreasing ``H_jj`` (the grid stays the analyzer's, so this changes codes, never scales). ``bounded``: each
    code stays at one of the two grid levels around its float weight (round down or up, as AdaRound and SignRound
    choose), however far the earlier columns' errors moved the weight GPTQ rounds.

    ``element``: a float element grid (``quant.floatgrid``; ``scale`` is then the effective scale and ``offset``
    zero): each column rounds to the nearest element value, and the codes returned are the element's codes. A
    GGUF type (``quant.ggml.GgmlType``; ``scale`` the effective sub-block steps, ``offset`` the minima in steps):
    each column rounds to the nearest value of its sub-block's grid.

    A batch of independent problems runs at once: ``weight`` ``(groups, out, in)`` with ``hessian``
    ``(groups, in, in)`` and ``scale``/``offset`` per element ``(groups, out, in)`` (a grouped convolution's rows,
    qtool.calibration.rounding.conv).

    A Hessian that is numerically not positive definite (few or collinear calibration tokens) gets more dampening,
    tenfold at a time; one that never becomes so (not finite: overflowed inputs) gives round-to-nearest codes.
    Either way one line saying so is appended to ``notes``."""
    if block_columns < 1 or not 0 <= dampening:
        raise ValueError("block_columns must be >= 1 and dampening >= 0")
    if not 0 <= shrinkage <= 1:
        raise ValueError("shrinkage must be between 0 and 1")
    # S, O: (groups, out, in // width), column j on block j // width (a 2-D weight's encoding is never expanded
    # to one value per weight: at a 1.1B model's down_proj that was 185 MB of the peak)
    W, H0, S, O = as_problems(weight, hessian, scale, offset, block_size, "GPTQ", by_column_block=True)
    cols = W.shape[-1]
    width = cols // S.shape[-1]
    W, H = W.clone(), (shrunk_hessian(H0, shrinkage) if shrinkage else H0.clone())
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    dead = diag <= 0
    H.masked_fill_(dead[:, :, None] | dead[:, None, :], 0.0)
    torch.diagonal(H, dim1=-2, dim2=-1).masked_fill_(dead, 1.0)
    perm = None
    block_of = [j // width for j in range(cols)]  # the scale/offset column of each (visited) input column
    if act_order:
        perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
        cols_of = perm[:, None, :].expand(W.shape)
        W = W.gather(2, cols_of)
        if width == 1:  # one value per column (a batch of problems): permuted with the columns
            S, O = S.gather(2, cols_of), O.gather(2, cols_of)
        else:  # one problem (2-D weights only come by column block)
            block_of = (perm[0] // width).tolist()
        H = H.gather(1, perm[:, :, None].expand(H.shape)).gather(2, perm[:, None, :].expand(H.shape))
    mean_diag = torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)
    torch.diagonal(H, dim1=-2, dim2=-1).add_(dampening * mean_diag[:, None])
    U, extra = _upper_inverse_cholesky(H)
    if U is None:
        if notes is not None:
            why = "is not finite (inputs too large for float32 sums)" if not bool(torch.isfinite(H).all()) else \
                "is not positive definite even with 1000 times its mean diagonal added"
            notes.append(f"the layer-input Hessian {why}: rounded to nearest, not GPTQ")
        rtn = _levels(W, S[..., block_of], O[..., block_of], qmin, qmax, element)
        if perm is not None:
            rtn = rtn.gather(2, torch.argsort(perm, dim=-1)[:, None, :].expand(rtn.shape))
        ties = torch.eye(cols, dtype=W.dtype, device=W.device).expand(H.shape)  # a finite H: the rows tie, RTN stays
        return keep_better_rows(weight, ties, rtn, scale, offset, qmin, qmax, block_size, element)
    del H  # only U is needed from here
    if notes is not None and bool((extra > 0).any()):
        used = dampening + float(extra.max()) * (1 + dampening)  # extra is relative to the dampened diagonal
        notes.append(f"GPTQ dampening raised from {dampening:g} to {used:.3g} of the mean diagonal: the "
                     "layer-input Hessian was not positive definite (few or collinear calibration tokens)")

    # column-major copies (groups, in, out): a column is one contiguous row, and a block's later columns one
    # contiguous slab, so the per-column steps below touch contiguous memory (the same float operations)
    Wt, St, Ot = (t.transpose(1, 2).contiguous() for t in (W, S, O))
    del W, S, O
    codes = torch.empty_like(Wt)
    bounds = _bounds(Wt, St, Ot, block_of, block_columns, qmin, qmax, element) if bounded else None
    graph = None if bounded else _CapturedColumns.make(Wt, qmin, qmax, element)
    if graph is not None:
        block_index = torch.tensor(block_of, device=Wt.device)
    for i1 in range(0, cols, block_columns):
        i2 = min(i1 + block_columns, cols)
        W1 = Wt[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)  # (groups, k, out): each column's scaled error, one contiguous row
        U1 = U[:, i1:i2, i1:i2]
        pivots = torch.diagonal(U1, dim1=-2, dim2=-1)[:, :, None]  # (groups, k, 1)
        k = i2 - i1
        for j1 in range(0, k, _SUB_BLOCK):  # the lazy batch again inside the block: each column's error goes
            j2 = min(j1 + _SUB_BLOCK, k)   # column by column to its sub-block only, then to the rest at once
            if graph is not None and j2 - j1 == _SUB_BLOCK:
                graph.run(W1[:, j1:j2], St, Ot, block_index[i1 + j1:i1 + j2], U1[:, j1:j2, j1:j2],
                          pivots[:, j1:j2], codes[:, i1 + j1:i1 + j2], E1[:, j1:j2])
            else:
                _columns(W1[:, j1:j2], [St[:, block_of[i1 + i]] for i in range(j1, j2)],
                         [Ot[:, block_of[i1 + i]] for i in range(j1, j2)], U1[:, j1:j2, j1:j2],
                         pivots[:, j1:j2], codes[:, i1 + j1:i1 + j2], E1[:, j1:j2], qmin, qmax, element,
                         None if bounds is None else tuple(b[:, i1 + j1:i1 + j2] for b in bounds))
            if j2 < k:
                W1[:, j2:] -= U1[:, j1:j2, j2:].transpose(1, 2) @ E1[:, j1:j2]
        Wt[:, i2:] -= U[:, i1:i2, i2:].transpose(1, 2) @ E1
    del graph, bounds
    del Wt, St, Ot, U  # freed before the row check below makes its own (out, in) and (in, in) temporaries
    codes = codes.transpose(1, 2)
    if perm is not None:
        codes = codes.gather(2, torch.argsort(perm, dim=-1)[:, None, :].expand(codes.shape))
    # GPTQ is greedy: on a small or nearly dead layer a row can end up worse than rounding to nearest. Rows are
    # independent, so each keeps whichever of the two has the smaller output error on the calibration inputs
    return keep_better_rows(weight, H0, codes, scale, offset, qmin, qmax, block_size, element, shrinkage)


def _columns(W: torch.Tensor, S: Sequence[torch.Tensor], O: Sequence[torch.Tensor], U: torch.Tensor,
             pivots: torch.Tensor, codes: torch.Tensor, errors: torch.Tensor, qmin: int, qmax: int,
             element: Optional[Grid], bounds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """GPTQ's column-by-column steps over one sub-block, in place. ``W`` ``(groups, k, out)``: the sub-block's
    columns (each updated with the errors of the earlier ones); ``S[i]``/``O[i]`` ``(groups, out)``: column ``i``'s
    scale and offset; ``U`` ``(groups, k, k)``: the sub-block of the inverse Cholesky factor, ``pivots`` its
    diagonal ``(groups, k, 1)``. Writes each column's codes to ``codes[:, i]`` and its scaled error to
    ``errors[:, i]`` (both ``(groups, k, out)``). ``bounds``: the lowest and highest level each column's codes may
    take (``bounded``), like ``codes``."""
    for i in range(W.shape[1]):
        w, s, o = W[:, i], S[i], O[i]
        # quantize / dequantize's own float32 steps, inline: this runs once per input column
        q = _levels(w, s, o, qmin, qmax, element)
        if bounds is not None:
            q = torch.minimum(torch.maximum(q, bounds[0][:, i].to(q.dtype)), bounds[1][:, i].to(q.dtype))
        codes[:, i] = q
        err = torch.div(torch.sub(w, _value(q, s, o, element)), pivots[:, i], out=errors[:, i])
        W[:, i + 1:] -= U[:, i, i + 1:, None] * err[:, None, :]


class _CapturedColumns:
    """:func:`_columns` over a full sub-block, recorded once per layer as a CUDA graph and replayed for each
    sub-block. On a GPU the column loop is a few small kernels per input column, so launching them costs far more
    than running them (about 170 µs a column on an H200, whatever the layer's size); a replay launches the whole
    sub-block at once. The replayed kernels are the ones the loop launches, on copies of the same values, so the
    codes are the loop's bit for bit (bench/gptq_columns.py compares them)."""

    def __init__(self, groups: int, out: int, like: torch.Tensor, qmin: int, qmax: int, element: Optional[Grid]):
        k = _SUB_BLOCK
        self.W, self.S, self.O, self.codes, self.errors = (like.new_ones(groups, k, out) for _ in range(5))
        self.U = like.new_ones(groups, k, k)
        self.pivots = like.new_ones(groups, k, 1)
        S, O = [self.S[:, i] for i in range(k)], [self.O[:, i] for i in range(k)]

        def step():
            _columns(self.W, S, O, self.U, self.pivots, self.codes, self.errors, qmin, qmax, element)

        # a warm-up on a side stream, then the capture on that stream (qtool.calibration.graphs.record); the loop
        # has no host sync, and the resumable state's writer thread may copy to the host meanwhile
        self.graph = record(step, like.device, find_syncs=False)

    @classmethod
    def make(cls, Wt: torch.Tensor, qmin: int, qmax: int, element: Optional[Grid]) -> Optional["_CapturedColumns"]:
        """A recorded sub-block for the columns of ``Wt`` ``(groups, in, out)``, or None where the loop runs as it
        is: off a GPU, with fewer columns than a sub-block, or for a grid whose rounding reads a table."""
        if (not CUDA_GRAPHS or Wt.device.type != "cuda" or Wt.shape[1] < _SUB_BLOCK
                or (isinstance(element, GgmlType) and element.table)):
            return None
        try:
            with torch.cuda.device(Wt.device):
                return cls(Wt.shape[0], Wt.shape[2], Wt, qmin, qmax, element)
        except RuntimeError:  # a capture refused (graphs.Refused), or no memory for it: the loop as it is (slower,
            # the same codes)
            return None

    def run(self, W: torch.Tensor, St: torch.Tensor, Ot: torch.Tensor, scale_columns: torch.Tensor,
            U: torch.Tensor, pivots: torch.Tensor, codes: torch.Tensor, errors: torch.Tensor) -> None:
        """:func:`_columns` on one sub-block: ``W`` its columns, ``St``/``Ot`` ``(groups, in // width, out)`` with
        ``scale_columns`` (a device tensor) naming each column's row of them."""
        self.W.copy_(W)
        torch.index_select(St, 1, scale_columns, out=self.S)
        torch.index_select(Ot, 1, scale_columns, out=self.O)
        self.U.copy_(U)
        self.pivots.copy_(pivots)
        self.graph.replay()
        codes.copy_(self.codes)
        errors.copy_(self.errors)


def _levels(w: torch.Tensor, s: torch.Tensor, o: torch.Tensor, qmin: int, qmax: int,
            element: Optional[Grid]) -> torch.Tensor:
    """The grid level nearest ``w`` whose value is ``(level + o) * s``: an integer code, or a float element's value
    (``o`` is then 0), exactly as the fake-quant forward rounds. A GGUF type's ``o`` is its minimum in steps (not
    an integer for Q4_K), and an IQ4 code ``q`` stands for the table value ``IQ4_TABLE[q + 8]``."""
    if element is None:
        return torch.round(w / s).sub_(o).clamp_(qmin, qmax)
    if isinstance(element, GgmlType):
        safe = torch.where(s == 0, torch.ones_like(s), s)
        if element.table:
            table = torch.tensor(IQ4_TABLE, dtype=w.dtype, device=w.device)
            return (torch.bucketize(w / safe, (table[1:] + table[:-1]) / 2) - 8).to(w.dtype)
        return torch.round(w / safe - o).clamp_(qmin, qmax)
    return element.round(torch.clamp(w / s, -element.max, element.max))


def _bounds(Wt: torch.Tensor, St: torch.Tensor, Ot: torch.Tensor, block_of: List[int], chunk: int, qmin: int,
            qmax: int, element: Optional[Grid]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``bounded``'s limits: each weight's levels just below and above its own float value, like ``Wt``
    ``(groups, in, out)``, kept in one or two bytes a value (int8 where the codes fit it, int16 for 8-bit
    asymmetric grids' 0..255; float elements' values, FP8's included, are exact in bfloat16), computed ``chunk``
    columns at a time."""
    dtype = (torch.bfloat16 if isinstance(element, FloatElement) else
             torch.int8 if -128 <= qmin and qmax <= 127 else torch.int16)
    low, high = (torch.empty(Wt.shape, dtype=dtype, device=Wt.device) for _ in range(2))
    for a in range(0, Wt.shape[1], chunk):
        b = min(a + chunk, Wt.shape[1])
        cols = block_of[a:b]
        below, above = _bracket(Wt[:, a:b], St[:, cols], Ot[:, cols], qmin, qmax, element)
        low[:, a:b], high[:, a:b] = below, above
    return low, high


def _bracket(w: torch.Tensor, s: torch.Tensor, o: torch.Tensor, qmin: int, qmax: int,
             element: Optional[Grid]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The grid levels just below and just above ``w`` (both the same where ``w`` is a level, or past the grid's
    end), in :func:`_levels`' terms: codes, or a float element's values."""
    if isinstance(element, FloatElement):
        values = element.values(torch.arange(element.num_codes, device=w.device))
        levels = torch.unique(values[torch.isfinite(values) & (values.abs() <= element.max)])  # sorted
        below, above = _neighbours(torch.clamp(w / s, -element.max, element.max), levels)
        return levels[below], levels[above]
    safe = s if element is None else torch.where(s == 0, torch.ones_like(s), s)
    if isinstance(element, GgmlType) and element.table:  # IQ4: code q stands for the sorted table's q + 8
        below, above = _neighbours(w / safe, torch.tensor(IQ4_TABLE, dtype=w.dtype, device=w.device))
        return (below - 8).to(w.dtype), (above - 8).to(w.dtype)
    x = w / safe - o
    return torch.floor(x).clamp_(qmin, qmax), torch.ceil(x).clamp_(qmin, qmax)


def _neighbours(x: torch.Tensor, levels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indices into the sorted ``levels`` of the last one ``<= x`` and the first one ``>= x`` (the end one past
    either end)."""
    last = len(levels) - 1
    return (torch.bucketize(x, levels, right=True) - 1).clamp_(0, last), torch.bucketize(x, levels).clamp_(0, last)


def _value(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, element: Optional[Grid]) -> torch.Tensor:
    """What level ``q`` (from :func:`_levels`) stands for."""
    if isinstance(element, GgmlType) and element.table:
        return torch.tensor(IQ4_TABLE, dtype=s.dtype, device=s.device)[q.long() + 8] * s
    return (q + o) * s


def as_problems(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                block_size, algorithm: str, by_column_block: bool = False):
    """``(W, H, S, O)``: a rounding algorithm's inputs checked and made a batch, float32 on the weight's device
    (``W``, ``S``, ``O`` ``(groups, out, in)``, ``H`` ``(groups, in, in)``; a 2-D weight is a batch of one, its
    encoding expanded to one scale and offset per element). ``W`` and ``H`` may share the caller's storage.

    ``by_column_block``: a 2-D weight's ``S``/``O`` are ``(1, out, in // width)`` instead, one value per row and
    block of ``width`` input columns (expanded along rows only, as a view where rows share it)."""
    if weight.dim() not in (2, 3) or hessian.dim() != weight.dim():
        raise ValueError(f"{algorithm} takes a 2-D (out, in) weight, got shape {list(weight.shape)}")
    cols = weight.shape[-1]
    if tuple(hessian.shape[-2:]) != (cols, cols) or hessian.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"Hessian of shape {list(hessian.shape)} does not fit a weight with {cols} input columns")
    dev = weight.device
    W = weight.detach().to(torch.float32)
    H = hessian.detach().to(dev, torch.float32)
    if weight.dim() == 3:
        return W, H, scale.to(dev, torch.float32).expand(W.shape), offset.to(dev, torch.float32).expand(W.shape)
    if by_column_block:
        S, O = (_by_column_block(t.to(dev, torch.float32), W.shape, block_size) for t in (scale, offset))
        return W[None], H[None], S[None], O[None]
    S = expand_encoding(scale.to(dev, torch.float32), W.shape, block_size)
    O = expand_encoding(offset.to(dev, torch.float32), W.shape, block_size)
    return W[None], H[None], S[None], O[None]


def shrunk_hessian(H: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """``(1 - shrinkage) · H + shrinkage · diag(H)`` (a new tensor): the input correlations ``H``'s off-diagonal
    holds, scaled down, each column's own importance kept."""
    diag = torch.diagonal(H, dim1=-2, dim2=-1).clone()
    out = H * (1.0 - shrinkage)
    torch.diagonal(out, dim1=-2, dim2=-1).copy_(diag)
    return out


def _by_column_block(t: torch.Tensor, weight_shape, block_size) -> torch.Tensor:
    """A 2-D weight's encoding tensor as ``(out, in // width)``: row ``r``, column ``j`` of the weight uses
    ``[r, j // width]``, the value :func:`expand_encoding` puts there."""
    out, cols = weight_shape
    blocks = resolve_block_size(weight_shape, t.shape, block_size)  # extents of the encoding's (trailing) dims
    rows_per = blocks[0] if t.dim() == 2 else out
    width = blocks[-1] if t.dim() >= 1 else cols
    t = t.reshape(out // rows_per, cols // width)
    if rows_per == 1:
        return t
    return t.expand(out, cols // width) if t.shape[0] == 1 else t.repeat_interleave(rows_per, dim=0)


def keep_better_rows(weight: torch.Tensor, H: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                     offset: torch.Tensor, qmin: int, qmax: int, block_size,
                     element: Optional[Grid] = None, shrinkage: float = 0.0) -> torch.Tensor:
    """A batch of codes (from :func:`as_problems`' shapes) back in the weight's shape, each output row keeping them
    or round-to-nearest's, whichever has the smaller ``d H dᵀ`` on the calibration inputs (``H`` shrunk toward
    its diagonal by ``shrinkage``, as GPTQ's objective was). For a float ``element`` ``codes`` holds element
    values (grid levels), and the result is the element's codes."""
    dev = weight.device
    if weight.dim() == 3:
        S, O = scale.to(dev, torch.float32).expand(weight.shape), offset.to(dev, torch.float32).expand(weight.shape)
        block_size = None
    else:
        codes, H = codes[0], H[0]
        S, O = scale.to(dev, torch.float32), offset.to(dev, torch.float32)
    W = weight.detach().to(torch.float32)
    if isinstance(element, GgmlType):  # a GGUF type: codes are integers, values from the type's own rule
        if weight.dim() == 2:
            S, O = expand_encoding(S, W.shape, block_size), expand_encoding(O, W.shape, block_size)
        rtn = _levels(W, S, O, qmin, qmax, element)
        keep = _first_no_worse(W, H, _value(codes, S, O, element), _value(rtn, S, O, element), shrinkage)
        return torch.where(keep[..., None], codes, rtn).to(torch.int64)
    if element is not None:  # levels are element values: compare per element, on the expanded scales
        S = expand_encoding(S, W.shape, block_size) if weight.dim() == 2 else S
        rtn = _levels(W, S, torch.zeros_like(S), qmin, qmax, element)
        keep = _first_no_worse(W, H, codes * S, rtn * S, shrinkage)
        return element.codes(torch.where(keep[..., None], codes, rtn))
    return _better_rows(W, H, codes, S, O, qmin, qmax, block_size, shrinkage)


def _first_no_worse(W: torch.Tensor, H: torch.Tensor, Wq1: torch.Tensor, Wq2: torch.Tensor,
                    shrinkage: float = 0.0) -> torch.Tensor:
    """Per output row, whether ``d1 H d1ᵀ <= d2 H d2ᵀ`` for the weight errors ``d = W - Wq`` (rows of the
    output error on the calibration inputs, squared and summed; ``H`` shrunk toward its diagonal by
    ``shrinkage``). Computed as ``(d1 - d2) H (d1 + d2)ᵀ <= 0`` in float64 (equal for a symmetric ``H``): one
    matmul, not two; rows with the same codes give exactly 0."""
    H = H.to(torch.float64)
    if shrinkage:  # (d1 - d2) Hs = (1 - s) (d1 - d2) H + s (d1 - d2) diag(H), without a shrunk copy of H
        diag = torch.diagonal(H, dim1=-2, dim2=-1)[..., None, :] * shrinkage
    keep = torch.empty(W.shape[:-1], dtype=torch.bool, device=W.device)
    step = max(1, _ROW_CHUNK_VALUES // W.shape[-1])  # rows a chunk: its float64 temporaries stay small
    for r in range(0, W.shape[-2], step):
        rows = slice(r, r + step)
        d1 = (W[..., rows, :] - Wq1[..., rows, :]).to(torch.float64)
        d2 = (W[..., rows, :] - Wq2[..., rows, :]).to(torch.float64)
        dH = (d1 - d2) @ H
        if shrinkage:
            dH = dH * (1.0 - shrinkage) + (d1 - d2) * diag
        keep[..., rows] = (dH * (d1 + d2)).sum(dim=-1) <= 0
    return keep


def _better_rows(W: torch.Tensor, H: torch.Tensor, codes: torch.Tensor, scale, offset, qmin: int, qmax: int,
                 block_size, shrinkage: float = 0.0) -> torch.Tensor:
    """Per output row, ``codes`` or round-to-nearest, whichever has the smaller ``d H dᵀ`` (``d`` the row's
    weight error: the row's squared output error summed over the calibration inputs); ties keep ``codes``."""
    rtn = quantize(W, scale, offset, qmin=qmin, qmax=qmax, block_size=block_size)
    keep = _first_no_worse(W, H, dequantize(codes, scale, offset, block_size=block_size),
                           dequantize(rtn, scale, offset, block_size=block_size), shrinkage)
    return torch.where(keep[..., None], codes, rtn).to(torch.int64)


def _upper_inverse_cholesky(H: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """``(U, extra)``: ``U`` upper-triangular with ``Uᵀ U = (H + extra · mean(diag H) · I)⁻¹`` for each matrix of the
    batch ``H`` ``(groups, n, n)``, where ``extra`` (per matrix) is 0, or 0.01 raised tenfold until the matrix is
    numerically positive definite (a layer fed few, nearly collinear tokens); ``U`` is None when 1000 is not
    enough (a Hessian that is not finite)."""
    extra = torch.zeros(len(H), dtype=H.dtype, device=H.device)
    if not bool(torch.isfinite(H).all()):
        return None, extra
    mean = torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)
    for _ in range(7):  # extra: 0, 0.01, 0.1, ... 1000
        # at most two (n, n) matrices beside H at any time: for a 14336-wide MLP input each is 0.8 GB
        Hd = H
        if bool((extra > 0).any()):
            Hd = H.clone()
            torch.diagonal(Hd, dim1=-2, dim2=-1).add_((extra * mean)[:, None])
        L, info = torch.linalg.cholesky_ex(Hd)
        del Hd
        ok = info == 0
        if bool(ok.all()):
            inverse = torch.cholesky_inverse(L)
            del L
            U, info = torch.linalg.cholesky_ex(inverse, upper=True)
            del inverse
            ok = info == 0
            if bool(ok.all()):
                return U, extra
        extra = torch.where(ok, extra, torch.where(extra == 0, torch.full_like(extra, 0.01), extra * 10))
    return None, extra
