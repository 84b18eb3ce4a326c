"""Argument checks shared by the public ops, the engine and the integrations (public, so that
an engine built on the ops checks its arguments with the same definitions).

Every check raises ``ValueError`` or ``TypeError`` whose message names the argument and
what it got, so a caller sees at once which input is wrong.  Value checks (ranges of
indices and parents) read tensor contents: they are cheap on CPU tensors and cost a device
synchronisation on CUDA, so the public ops run them by default only on CPU tensors.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from specdec_kernels._eager import filled

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def as_int(name: str, value) -> int:
    """``value`` as a Python int: an int, a numpy integer or a 0-d integer tensor.  Floats,
    bools and anything else raise TypeError naming the argument (never truncated)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def integer_at_least(name: str, value, low: int) -> int:
    """``value`` as an int when it is an integer (an int, or a float or tensor of integral
    value; never a bool) of at least ``low``.

    Raises:
        ValueError: anything else, naming the argument ("window must be an integer >= 1").
    """
    try:
        ok = not isinstance(value, bool) and int(value) == value and value >= low
    except (TypeError, ValueError, RuntimeError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def as_int_list(name: str, values) -> List[int]:
    """``values`` (a sequence of ints, or an integer tensor) as a list of Python ints, each
    checked by ``as_int`` (``name[i]`` in the message)."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a {values.dtype} tensor")
        values = values.tolist()
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def layer_indices(name: str, layers, num_layers: Optional[int] = None) -> Tuple[int, ...]:
    """``layers`` (a sequence of ints: layer indices, e.g. EAGLE-3's feature layers) as a
    tuple of distinct Python ints in [0, num_layers) (no upper bound when None).

    Raises:
        TypeError: not a sequence (a str included), or an element that is not an int
            (``as_int``), naming the argument.
        ValueError: an index below 0 or at least ``num_layers``, or one repeated.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, torch.Tensor)):
        raise TypeError(f"{name} must be a sequence of layer indices, got {type(layers).__name__} {layers!r}")
    out = tuple(as_int_list(name, layers))
    for i in out:
        if i < 0 or (num_layers is not None and i >= num_layers):
            bound = "" if num_layers is None else f" and below the {num_layers} layers"
            raise ValueError(f"{name}: layer {i} is not an index >= 0{bound}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} repeats a layer: {list(out)}")
    return out


# float32, the dtype the sampling kernels take: its largest finite value, its smallest normal
# value, and the largest positive number that rounds to 0.0 in it (round to nearest, ties to even)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
FLOAT32_ROUNDS_TO_ZERO = 2.0**-150
INT64_MAX = 2**63 - 1


def as_real(name: str, value, *, finite: bool = False) -> float:
    """``value`` as a Python float: an int, a float or another real number (numpy's, a
    ``Fraction``), never a bool, not NaN, and finite when ``finite``.  The range checks of the
    callers compare the value as given, before any rounding.

    Raises:
        TypeError: a bool, a string, a tensor or anything else that is not a real number.
        ValueError: NaN, or an infinity when ``finite``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if value != value:  # NaN, in any real type
        raise ValueError(f"{name} must be a number, got NaN")
    if finite and value in (math.inf, -math.inf):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def sampling_temperature(name: str, value, *, finite: bool = False) -> float:
    """A sampling temperature checked as given (a real number >= 0; finite when ``finite``;
    +inf otherwise allowed: a uniform distribution), returned as the value the float32
    kernels take.  Rounding to float32 never carries it out of its range: a value above
    float32's largest (3.4e38) becomes that largest value (a near-uniform distribution that
    keeps the order of the logits for top-k), and a positive value <= 2**-150 rounds to 0.0,
    greedy decoding (the limit of ever smaller temperatures; ``temperature_is_greedy``).

    Raises:
        TypeError: not a real number (a bool included).
        ValueError: NaN, negative, or infinite when ``finite`` (the message names ``name``).
    """
    value = as_real(name, value, finite=finite)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 is greedy), got {value}")
    if value > FLOAT32_MAX and value != math.inf:
        return FLOAT32_MAX
    return float(value)


def temperature_is_greedy(temperature) -> bool:
    """Whether the kernels decode greedily at this (checked) temperature: it is 0, or so small
    that it rounds to 0.0 in float32 (<= 2**-150)."""
    return temperature <= FLOAT32_ROUNDS_TO_ZERO


def sampling_top_p(name: str, value) -> float:
    """A top-p checked as given (a real number in (0, 1]), returned as the value the float32
    kernels take: a positive value below float32's smallest normal (1.2e-38, e.g. 1e-50, which
    would round to 0.0, outside the range) becomes that smallest normal.  The nucleus is the
    same either way: the most probable token and its ties, since a row's largest probability
    is at least 1 / vocab.

    Raises:
        TypeError: not a real number (a bool included).
        ValueError: NaN or outside (0, 1] (the message names ``name``).
    """
    value = as_real(name, value)
    if not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value}")
    return max(float(value), FLOAT32_TINY)


def sampling_top_k(name: str, value) -> int:
    """A top-k checked as given (an int >= 0; 0 disables it), returned as the value the int64
    kernels take: one above int64's range becomes int64's largest (>= the vocabulary either
    way: disabled).

    Raises:
        TypeError: not an int (a bool or a float, even an integral one, included).
        ValueError: negative (the message names ``name``).
    """
    value = as_int(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 disables it), got {value}")
    return min(value, INT64_MAX)


def check_tensor(
    name: str,
    t,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank, dtype and device; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and (t.ndim != ndim if isinstance(ndim, int) else t.ndim not in ndim):
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        want = " or ".join(str(a) for a in allowed)
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    """Raise ValueError unless ``t.shape == expected``."""
    if t.shape != (expected if isinstance(expected, tuple) else tuple(expected)):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(t.shape)}")


def want_value_checks(validate: Optional[bool], *tensors: torch.Tensor) -> bool:
    """Value checks default to on for CPU tensors and off elsewhere (they need a sync)."""
    if validate is not None:
        return bool(validate)
    return all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))


def check_counts(name: str, counts, batch: int, upper: int, device, validate: Optional[bool]) -> torch.Tensor:
    """Check a per-sequence count tensor [B] with values in 0..upper; None means ``upper``.

    Returns an int64 tensor on ``device`` (for None, a constant tensor the caller only reads:
    no kernel on the eager path, ``specdec_kernels._eager.filled``).
    """
    if counts is None:
        return filled(batch, upper, torch.int64, device)
    check_tensor(name, counts, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if counts.shape[0] != batch:
        check_shape(name, counts, (batch,), "one count per sequence")
    if validate is not False and want_value_checks(validate, counts) and counts.numel() > 0:
        lo, hi = int(counts.min()), int(counts.max())
        if lo < 0 or hi > upper:
            raise ValueError(f"{name} must lie in 0..{upper}, got values in {lo}..{hi}")
    return counts if counts.dtype == torch.int64 else counts.to(torch.int64)


def check_parents(
    name: str, parents, batch: int, num_nodes: int, device, validate: Optional[bool], expand: bool = True
) -> torch.Tensor:
    """Check a parent list [N] or [B, N]: parents[0] == -1 and 0 <= parents[i] < i.

    Returns int64 parents of shape [B, N] (a shared tree is expanded, not copied); with
    ``expand=False`` a shared tree stays [N] (a kernel that reads it with batch stride 0 saves
    the view).
    """
    check_tensor(name, parents, ndim=(1, 2), dtypes=INDEX_DTYPES, device=device)
    if parents.is_meta:
        raise ValueError(f"{name} is on the meta device: walking a token tree needs its parent values")
    if parents.dim() == 1:
        check_shape(name, parents, (num_nodes,), "one parent per tree node")
    else:
        check_shape(name, parents, (batch, num_nodes), "one parent list per sequence")
    if want_value_checks(validate, parents) and parents.numel() > 0:
        p = parents.reshape(-1, num_nodes).to(torch.int64)
        if (p[:, 0] != -1).any():
            raise ValueError(f"{name}[..., 0] must be -1 (node 0 is the root), got {p[:, 0].tolist()[:8]}")
        if num_nodes > 1:
            idx = torch.arange(num_nodes, device=p.device)
            bad = (p[:, 1:] < 0) | (p[:, 1:] >= idx[1:])
            if bad.any():
                row, col = (int(v) for v in bad.nonzero()[0])
                raise ValueError(
                    f"{name} must satisfy 0 <= parents[i] < i (topological order); "
                    f"node {col + 1} has parent {int(p[row, col + 1])}"
                )
    p = parents if parents.dtype == torch.int64 else parents.to(torch.int64)
    return p.expand(batch, num_nodes) if expand and p.dim() == 1 else p


def check_scores(name: str, t, rows: str) -> Tuple[int, int, int]:
    """Check a (batch, rows, vocab) float tensor of scores or probabilities with at least one
    row (``rows`` says which, in the message) and a vocabulary of at least 1; return its shape."""
    check_tensor(name, t, ndim=3, dtypes=FLOAT_DTYPES)
    B, R, V = t.shape
    if R < 1:
        raise ValueError(f"{name} must have {rows}, got shape {tuple(t.shape)}")
    if V < 1:
        raise ValueError(f"{name} must have a vocabulary of at least 1, got shape {tuple(t.shape)}")
    return B, R, V


def check_tree(
    rows_name: str, tree_tokens, tree_parents, batch: int, num_nodes: int, device, validate, expand: bool = True
) -> torch.Tensor:
    """Check a token tree's ``tree_tokens`` (batch, N) and ``tree_parents`` (N,) or (batch, N)
    against the (batch, N, vocab) tensor ``rows_name``; return the parents as int64 (batch, N)
    (with ``expand=False``, a shared tree as (N,))."""
    check_tensor("tree_tokens", tree_tokens, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if tree_tokens.shape != (batch, num_nodes):
        check_shape("tree_tokens", tree_tokens, (batch, num_nodes), f"one token per tree node, like {rows_name}' rows")
    return check_parents("tree_parents", tree_parents, batch, num_nodes, device, validate, expand)


def check_probs(name: str, t, ndim: int, device=None) -> torch.Tensor:
    """A probability tensor's form: float32/float16/bfloat16 of rank ``ndim`` on ``device``
    (its values: ``check_probability_values``)."""
    return check_tensor(name, t, ndim=ndim, dtypes=FLOAT_DTYPES, device=device)


def check_probability_values(
    name: str, t: torch.Tensor, validate: Optional[bool], used_rows: Optional[torch.Tensor] = None
) -> None:
    """With ``validate=True`` only: every entry of the rows of ``t`` (..., V) that the op uses
    is a probability weight, finite and >= 0 (rows need not sum to 1).  Raw logits (negative
    entries), NaN and infinities are refused.  With ``validate`` None or False nothing is read
    (a scan of every row would grow the default path's host cost; the ops' NaN handling,
    e.g. ``RejectionSampleDetails.valid``, covers unchecked calls).

    Args:
        name: the argument's name, for the message.
        t: float tensor (..., V).
        validate: the op's ``validate``; only True checks.
        used_rows: bool (...) mask of the rows the op reads (None: all); entries of the other
            rows (padding past a count) are ignored whatever they hold.

    Raises:
        ValueError: naming the argument, the first bad entry's index and value, and its kind.
    """
    if not validate or t.numel() == 0:
        return
    bad = ~((t >= 0) & (t < math.inf))  # NaN fails both comparisons
    if used_rows is not None:
        bad &= used_rows[..., None]
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        value = float(t[index])
        kind = "NaN" if value != value else ("infinite" if value in (math.inf, -math.inf) else "negative")
        where = ", ".join(str(i) for i in index)
        raise ValueError(
            f"{name} must hold probabilities (finite and >= 0; checked with validate=True), got "
            f"{name}[{where}] = {value} ({kind}); logits go through sampling_probs (or a softmax) first"
        )


# The largest float32 below 1: a float64 uniform just below 1 rounds to 1.0 in float32.
FLOAT32_BELOW_ONE = 1.0 - 2.0**-24


UNIFORM_DTYPES = (torch.float32, torch.float64)


def check_uniforms(name: str, u, expected: Sequence[int], device, validate: Optional[bool] = None) -> torch.Tensor:
    """Explicit random numbers: a float32/float64 tensor of the expected shape on ``device``,
    its values in [0, 1) (read only when ``validate`` allows, see ``want_value_checks``).

    Returned as given: nothing is cast or cleaned here (no torch op without value checks).
    The kernels make every uniform safe themselves, as ``clamp_uniforms`` does, whatever was
    validated.

    Raises:
        TypeError: not a tensor, or not float32/float64.
        ValueError: the wrong shape or device; with value checks, a value outside [0, 1) or NaN.
    """
    check_tensor(name, u, dtypes=UNIFORM_DTYPES, device=device)
    if u.shape != expected:
        check_shape(name, u, expected)
    if validate is not False and want_value_checks(validate, u) and u.numel() > 0:
        lo, hi = float(u.min()), float(u.max())
        if not (lo >= 0.0 and hi < 1.0):
            raise ValueError(f"{name} must lie in [0, 1), got values in [{lo}, {hi}]")
    return u


def clamp_uniforms(u: torch.Tensor) -> torch.Tensor:
    """Uniforms as the sampling kernels use them: cast to float32, NaN read as 0, clamped into
    [0, 1 - 2**-24], so that a coin never becomes 1.0 by rounding and no value outside [0, 1)
    reaches an inverse-CDF search.

    Args:
        u: a float32/float64 tensor of any shape.

    Returns:
        A float32 tensor of ``u``'s shape (elementwise torch ops: the references and adapters
        use it; the kernels do the same per value inside).
    """
    return torch.nan_to_num(u.to(torch.float32), nan=0.0).clamp(0.0, FLOAT32_BELOW_ONE)


# The layouts of a paged cache's block: "NHD" is [block_size, Hkv, D], "HND" [Hkv, block_size, D].
KV_LAYOUTS = ("NHD", "HND")


def check_kv_layout(kv_layout) -> str:
    """``kv_layout``: "NHD" (a block is [block_size, Hkv, D]) or "HND" ([Hkv, block_size, D])."""
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout must be a str ('NHD' or 'HND'), got {type(kv_layout).__name__}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return kv_layout


# The layouts of tree_attention's q (FlashInfer's names): "NHD" is [B, N, H, D] (ours), "HND"
# [B, H, N, D] (transformers' attention functions receive q so).
Q_LAYOUTS = ("NHD", "HND")


def check_q_layout(q_layout) -> str:
    """``q_layout``: "NHD" (q is [batch, N, heads, head_dim]) or "HND" ([batch, heads, N,
    head_dim], transformers' layout).

    Raises:
        TypeError: not a str.  ValueError: another string.
    """
    if not isinstance(q_layout, str):
        raise TypeError(f"q_layout must be a str ('NHD' or 'HND'), got {type(q_layout).__name__}")
    if q_layout not in Q_LAYOUTS:
        raise ValueError(
            f"q_layout must be 'NHD' (q is (batch, N, heads, head_dim)) or 'HND' ((batch, heads, N, head_dim), "
            f"transformers' layout), got {q_layout!r}"
        )
    return q_layout


def pool_geometry(pool: torch.Tensor, kv_layout: str) -> Tuple[int, int, int, int]:
    """(num_blocks, block_size, Hkv, D) of one per-layer pool tensor in ``kv_layout``."""
    if kv_layout == "NHD":
        num_blocks, block_size, heads, head_dim = pool.shape
    else:
        num_blocks, heads, block_size, head_dim = pool.shape
    return num_blocks, block_size, heads, head_dim
