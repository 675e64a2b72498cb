"""block(d, heads): a pre-LayerNorm transformer block with causal multi-head self-attention.

On a sequence x of T positions of width d:
  r = x + attn(ln1(x)),  y = r + fc2(gelu(fc1(ln2(r))))      (fc1: d -> 4d, fc2: 4d -> d)
attn is torch.nn.MultiheadAttention(d, heads, batch_first=True) with a causal mask: per head h
of width e = d / heads, [q | k | v] = ln1(x) in_proj_weight^T + in_proj_bias, scores
s_tu = q_t . k_u / sqrt(e) for u <= t (later positions masked), P = softmax over u, o_t = sum_u
P_tu v_u, and the heads' outputs side by side through out_proj. The parameters are named as
PyTorch names a module with attributes ln1, attn, ln2, fc1, fc2.

The block is its layers (layernorm, dense, gelu), run in order forward and in reverse backward,
and the attention core between the two dense layers of attn. The core is per sample, in a fixed
order (its products loop over positions and a head's features in index order): a sequence's
output and gradient do not depend on the sequences beside it. Its backward pass, from do:
  dP_tu = do_t . v_u,  dv_u = sum_t P_tu do_t,  ds_tu = P_tu (dP_tu - sum_u' P_tu' dP_tu'),
  dq_t = sum_u ds_tu k_u / sqrt(e),  dk_u = sum_t ds_tu q_t / sqrt(e)
Float mode (`nx.free_order`) takes the core's products through BLAS instead, one per sample and
head on the heads' copies side by side ((m, heads, T, e): q scaled by 1 / sqrt(e) as it is
copied), the whole T x T scores (the masked ones zeroed by the softmax, so that the products
after it may run whole too); its softmax is one pass per row (in float32 with `exp_float32`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import overload

from syncsgd.nn.layers.base import Layer, Param, Primitives, Shape
from syncsgd.nn.layers.dense import Dense
from syncsgd.nn.layers.gelu import GELU, exp_float32
from syncsgd.nn.layers.layernorm import LayerNorm

# each inner layer with its parameters' names in the block (weight, bias), in PyTorch's order
NAMES = {"ln1": ("ln1.weight", "ln1.bias"),
         "in_proj": ("attn.in_proj_weight", "attn.in_proj_bias"),
         "out_proj": ("attn.out_proj.weight", "attn.out_proj.bias"),
         "ln2": ("ln2.weight", "ln2.bias"),
         "fc1": ("fc1.weight", "fc1.bias"),
         "fc2": ("fc2.weight", "fc2.bias")}  # fmt: skip

# the block's inner activations (each with its gradient), their widths in multiples of d: ln1's
# output, [q | k | v], the heads' outputs, out_proj's, the residual sum, ln2's, fc1's, gelu's, fc2's
INNER_WIDTHS = {"h1": 1, "qkv": 3, "att": 1, "a": 1, "r1": 1, "h2": 1, "f1": 4, "f1g": 4, "f2": 1}


class Block(Layer):
    """A pre-LayerNorm transformer block: causal multi-head self-attention, then a GELU MLP."""

    kind = "block"
    signature = "block(d, heads)"

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        if d < 1 or heads < 1 or d % heads:
            raise ValueError(f"block({d}, {heads}): d and heads must be >= 1, d a multiple of "
                             "heads")  # fmt: skip
        self.d, self.heads = d, heads
        self.ln1, self.ln2, self.gelu = LayerNorm(), LayerNorm(), GELU()
        self.in_proj, self.out_proj = Dense(3 * d), Dense(d)
        self.fc1, self.fc2 = Dense(4 * d), Dense(d)

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """(T, d): the input's shape; builds the inner layers."""
        if len(in_shape) != 2 or in_shape[1] != self.d:
            raise ValueError(f"{self.describe()} needs sequences of width {self.d} (T, {self.d}), "
                             f"got shape {in_shape}")  # fmt: skip
        positions, d = in_shape
        shapes = {"ln1": (positions, d), "in_proj": (positions, d),
                  "out_proj": (positions, d), "ln2": (positions, d),
                  "fc1": (positions, d), "gelu": (positions, 4 * d),
                  "fc2": (positions, 4 * d)}  # fmt: skip
        for name, shape in shapes.items():
            inner: Layer = getattr(self, name)
            inner.name = name
            inner.build(self.position, shape, 0, False)
        return in_shape

    def params(self) -> list[Param]:
        """The inner layers' parameters under PyTorch's names; attn's as MultiheadAttention
        starts them (in_proj_weight Xavier-uniform, both biases 0)."""
        d = self.d
        xavier = math.sqrt(6.0 / (d + 3 * d))
        found = []
        for name, (weight, bias) in NAMES.items():
            own = getattr(self, name).params()
            if name in ("in_proj", "out_proj"):
                first = Param(weight, own[0].shape, "uniform",
                              xavier if name == "in_proj" else own[0].bound)  # fmt: skip
                found += [first, Param(bias, own[1].shape, "zeros")]
            else:
                found += [Param(weight, *_rest(own[0])), Param(bias, *_rest(own[1]))]
        return found

    def _views(self, arrays: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
        """An inner layer's arrays by its own names (weight, bias)."""
        weight, bias = NAMES[name]
        return {"weight": arrays[weight], "bias": arrays[bias]}

    def _spaces(self, nx: Primitives, like: np.ndarray) -> dict[str, np.ndarray]:
        """The inner activations and their gradients for m sequences, in the pass's dtype."""
        spaces, (m, positions, d) = self.workspaces(nx), like.shape
        made = {}
        for name, times in INNER_WIDTHS.items():  # kept for the backward pass; their gradients
            made[name] = spaces.keep(name, (m, positions, times * d), like.dtype)
            made["d_" + name] = spaces.get("d_" + name, (m, positions, times * d), like.dtype)
        made["probs"] = spaces.keep("probs", (m, self.heads, positions, positions), like.dtype)
        made["d_probs"] = spaces.get("d_probs", (m, self.heads, positions, positions),
                                     like.dtype)  # fmt: skip
        # one head's keys (forward) or values (backward), a feature per row: the kernels'
        made["head"] = spaces.get("head", (d // self.heads, positions), like.dtype)
        return made

    def _head_spaces(self, nx: Primitives, like: np.ndarray) -> dict[str, np.ndarray]:
        """Float mode's copies of [q | k | v] by head (kept), and the heads' outputs or their
        gradients by head and the gradients at q, k, v by head (scratch): (3 or 1, m, heads,
        T, e) each."""
        spaces, (m, positions, d) = self.workspaces(nx), like.shape
        shape = (m, self.heads, positions, d // self.heads)
        return {"qkv_heads": spaces.keep("qkv_heads", (3, *shape), like.dtype),
                "out_heads": spaces.get("out_heads", (1, *shape), like.dtype),
                "d_qkv_heads": spaces.get("d_qkv_heads", (3, *shape), like.dtype)}  # fmt: skip

    def _attention_(self, nx: Primitives, s: dict[str, np.ndarray]) -> None:
        """att = the heads' attention of qkv (probs: their weights), as the mode runs it."""
        if not nx.free_order:
            attention_(nx, self.heads, s["qkv"], s["probs"], s["att"], s["head"])
            return
        h = self._head_spaces(nx, s["att"])
        scale = 1.0 / math.sqrt(self.d // self.heads)
        split_heads_(s["qkv"], scale, h["qkv_heads"])
        free_attention_(h["qkv_heads"], s["probs"], h["out_heads"][0])
        merge_heads_(h["out_heads"], 1.0, s["att"])

    def _attention_backward_(self, nx: Primitives, s: dict[str, np.ndarray]) -> None:
        """d_qkv = the gradient at qkv from d_att, as the mode runs it."""
        if not nx.free_order:
            attention_backward_(nx, self.heads, s["qkv"], s["probs"], s["d_att"], s["d_probs"],
                                s["d_qkv"], s["head"])  # fmt: skip
            return
        h = self._head_spaces(nx, s["att"])
        scale = 1.0 / math.sqrt(self.d // self.heads)
        split_heads_(s["d_att"], 1.0, h["out_heads"])
        free_attention_backward_(h["qkv_heads"], s["probs"], h["out_heads"][0], s["d_probs"],
                                 h["d_qkv_heads"])  # fmt: skip
        merge_heads_(h["d_qkv_heads"], scale, s["d_qkv"])

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """r = round(x + attn(ln1(x))), y = round(r + fc2(gelu(fc1(ln2(r)))))."""
        s = self._spaces(nx, x)
        self.ln1.forward_(nx, self._views(p, "ln1"), x, s["h1"])
        self.in_proj.forward_(nx, self._views(p, "in_proj"), s["h1"], s["qkv"])
        self._attention_(nx, s)
        self.out_proj.forward_(nx, self._views(p, "out_proj"), s["att"], s["a"])
        np.add(x, s["a"], out=s["r1"])
        nx.round_(s["r1"])
        self.ln2.forward_(nx, self._views(p, "ln2"), s["r1"], s["h2"])
        self.fc1.forward_(nx, self._views(p, "fc1"), s["h2"], s["f1"])
        self.gelu.forward_(nx, {}, s["f1"], s["f1g"])
        self.fc2.forward_(nx, self._views(p, "fc2"), s["f1g"], s["f2"])
        np.add(s["r1"], s["f2"], out=y)
        nx.round_(y)

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """Every inner layer's sums, top down; the gradient inside the block on the way (the
        gradient at x itself waits for backward_input_)."""
        s = self._spaces(nx, x)
        w = {name: self._views(p, name) for name in NAMES}  # each inner layer's weight, bias
        sums = {name: self._views(g, name) for name in NAMES}  # and their gradients' sums
        self.fc2.backward_sums_(nx, w["fc2"], sums["fc2"], s["f1g"], s["f2"], dy)
        self.fc2.backward_input_(nx, w["fc2"], s["f1g"], s["f2"], dy, s["d_f1g"])
        self.gelu.backward_input_(nx, {}, s["f1"], s["f1g"], s["d_f1g"], s["d_f1"])
        self.fc1.backward_sums_(nx, w["fc1"], sums["fc1"], s["h2"], s["f1"], s["d_f1"])
        self.fc1.backward_input_(nx, w["fc1"], s["h2"], s["f1"], s["d_f1"], s["d_h2"])
        self.ln2.backward_sums_(nx, w["ln2"], sums["ln2"], s["r1"], s["h2"], s["d_h2"])
        self.ln2.backward_input_(nx, w["ln2"], s["r1"], s["h2"], s["d_h2"], s["d_r1"])
        s["d_r1"] += dy  # the residual path: r reaches y directly and through the MLP
        nx.round_(s["d_r1"])
        self.out_proj.backward_sums_(nx, w["out_proj"], sums["out_proj"], s["att"], s["a"],
                                     s["d_r1"])  # fmt: skip
        self.out_proj.backward_input_(nx, w["out_proj"], s["att"], s["a"], s["d_r1"], s["d_att"])
        self._attention_backward_(nx, s)
        self.in_proj.backward_sums_(nx, w["in_proj"], sums["in_proj"], s["h1"], s["qkv"],
                                    s["d_qkv"])  # fmt: skip
        self.in_proj.backward_input_(nx, w["in_proj"], s["h1"], s["qkv"], s["d_qkv"], s["d_h1"])
        self.ln1.backward_sums_(nx, w["ln1"], sums["ln1"], x, s["h1"], s["d_h1"])

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """dx = round(d_r + ln1's gradient at x): the residual path and the attention's."""
        s = self._spaces(nx, x)
        self.ln1.backward_input_(nx, self._views(p, "ln1"), x, s["h1"], s["d_h1"], dx)
        dx += s["d_r1"]
        nx.round_(dx)

    def inner_size(self) -> int:
        """Its inner activations and their gradients, the attention's weights, its layers'."""
        positions, d = self.in_shape
        inner = 2 * positions * d * sum(INNER_WIDTHS.values()) + 2 * self.heads * positions**2
        return inner + self.ln1.inner_size() + self.ln2.inner_size() + self.gelu.inner_size()

    def kept_bytes(self, m: int, itemsize: int) -> int:
        """Its inner activations, the attention's T x T weights per head, its layer norms'."""
        positions, d = self.in_shape
        values = m * (positions * d * sum(INNER_WIDTHS.values()) + self.heads * positions**2)
        norms = self.ln1.kept_bytes(m, itemsize) + self.ln2.kept_bytes(m, itemsize)
        return values * itemsize + norms + self.gelu.kept_bytes(m, itemsize)

    def scratch_bytes(self, m: int, itemsize: int) -> int:
        """The gradients at its inner activations and at the attention's weights, one head's
        keys, its layer norms' scratch."""
        positions, d = self.in_shape
        values = m * (positions * d * sum(INNER_WIDTHS.values()) + self.heads * positions**2)
        norms = self.ln1.scratch_bytes(m, itemsize) + self.ln2.scratch_bytes(m, itemsize)
        return (values + d // self.heads * positions) * itemsize + norms

    def free_kept_bytes(self, m: int, itemsize: int) -> int:
        """As in the other modes (but GELU's, which is its own), and float mode's copies of
        [q | k | v] by head."""
        positions, d = self.in_shape
        own = self.kept_bytes(m, itemsize) - self.gelu.kept_bytes(m, itemsize)
        return own + self.gelu.free_kept_bytes(m, itemsize) + 3 * m * positions * d * itemsize

    def free_scratch_bytes(self, m: int, itemsize: int) -> int:
        """As in the other modes, and float mode's heads' outputs and gradients by head."""
        positions, d = self.in_shape
        return self.scratch_bytes(m, itemsize) + 4 * m * positions * d * itemsize

    def model_width(self) -> int:
        """d."""
        return self.d

    def multiply_adds(self) -> int:
        """Its four dense products, and attention's two T x T x d ones (scores, then values)."""
        dense = (self.in_proj, self.out_proj, self.fc1, self.fc2)
        return sum(layer.multiply_adds() for layer in dense) + self.attention_multiply_adds()

    def attention_multiply_adds(self) -> int:
        """The attention core's per sample: q k^T and P v, T x T x e for each of the heads."""
        positions = self.in_shape[0]
        return 2 * positions * positions * self.d

    def describe(self) -> str:
        """block(d, heads)."""
        return f"block({self.d}, {self.heads})"


def _rest(param: Param) -> tuple[Any, ...]:
    """A parameter's shape, init and bound (its name given anew)."""
    return param.shape, param.init, param.bound


def attention_(nx: Primitives, heads: int, qkv: np.ndarray, probs: np.ndarray,
               out: np.ndarray, head: np.ndarray) -> None:  # fmt: skip
    """out = the heads' causal attention of [q | k | v], side by side; probs: P per head
    (head: an (e, T) workspace)."""
    scale = 1.0 / math.sqrt(qkv.shape[2] // 3 // heads)
    scores_(qkv, heads, scale, probs, head)
    nx.round_(probs)
    causal_softmax_(probs)
    nx.round_(probs)
    attend_(probs, qkv, heads, out)
    nx.round_(out)


def attention_backward_(nx: Primitives, heads: int, qkv: np.ndarray, probs: np.ndarray,
                        d_out: np.ndarray, d_probs: np.ndarray, d_qkv: np.ndarray,
                        head: np.ndarray) -> None:  # fmt: skip
    """d_qkv = the gradient at [q | k | v] from d_out (d_probs, head: workspaces)."""
    scale = 1.0 / math.sqrt(qkv.shape[2] // 3 // heads)
    attend_backward_(probs, qkv, d_out, heads, d_probs, d_qkv, head)
    nx.round_(d_probs)
    causal_softmax_backward_(probs, d_probs)
    nx.round_(d_probs)
    scores_backward_(d_probs, qkv, heads, scale, d_qkv)
    nx.round_(d_qkv)


@njit(nogil=True, cache=True)
def scores_(qkv, heads, scale, probs, keys):
    """probs[i, h, t, u] = (q_t . k_u) scale for u <= t, else 0 (head h's features); each dot
    product summed over the features in index order (`lower_products_`); keys: an (e, T)
    workspace, one head's keys a feature per row."""
    m, positions, width = qkv.shape
    d = width // 3
    e = d // heads
    for i in range(m):
        for h in range(heads):
            for u in range(positions):
                for f in range(e):
                    keys[f, u] = qkv[i, u, d + h * e + f]
            lower_products_(qkv[i, :, h * e : (h + 1) * e], keys, probs[i, h])
            for t in range(positions):
                row = probs[i, h, t]
                for u in range(t + 1):
                    row[u] *= scale


@njit(nogil=True, cache=True)
def lower_products_(a, b_rows, out):
    """out[t, u] = sum over f of a[t, f] b_rows[f, u] for u <= t (f ascending, from 0), else 0:
    four rows at a time, each element's sum in the order of a row alone."""
    positions, e = a.shape
    full = positions - positions % 4
    for t0 in range(0, full, 4):
        r0, r1, r2, r3 = out[t0], out[t0 + 1], out[t0 + 2], out[t0 + 3]
        r0[:] = 0
        r1[:] = 0
        r2[:] = 0
        r3[:] = 0
        for f in range(e):
            a0, a1, a2, a3 = a[t0, f], a[t0 + 1, f], a[t0 + 2, f], a[t0 + 3, f]
            b = b_rows[f]
            for u in range(t0 + 4):
                r0[u] += a0 * b[u]
                r1[u] += a1 * b[u]
                r2[u] += a2 * b[u]
                r3[u] += a3 * b[u]
        r0[t0 + 1 :] = 0  # past each row's own t: as if never summed
        r1[t0 + 2 :] = 0
        r2[t0 + 3 :] = 0
    for t in range(full, positions):
        row = out[t]
        row[:] = 0
        for f in range(e):
            factor = a[t, f]
            for u in range(t + 1):
                row[u] += factor * b_rows[f, u]


@njit(nogil=True, cache=True)
def causal_softmax_(probs):
    """Each row t over u <= t: softmax in float64 (shifted by its maximum); masked stay 0."""
    m, heads, positions, _ = probs.shape
    for i in range(m):
        for h in range(heads):
            for t in range(positions):
                top = np.float64(probs[i, h, t, 0])
                for u in range(1, t + 1):
                    top = max(top, np.float64(probs[i, h, t, u]))
                total = 0.0
                for u in range(t + 1):
                    total += np.exp(np.float64(probs[i, h, t, u]) - top)
                for u in range(t + 1):
                    probs[i, h, t, u] = np.exp(np.float64(probs[i, h, t, u]) - top) / total


@njit(nogil=True, cache=True)
def attend_(probs, qkv, heads, out):
    """out[i, t, head h's features] = sum over u <= t of P_tu v_u, u ascending."""
    m, positions, width = qkv.shape
    d = width // 3
    e = d // heads
    out[:] = 0
    for i in range(m):
        for h in range(heads):
            values = slice(2 * d + h * e, 2 * d + (h + 1) * e)
            for t in range(positions):
                o = out[i, t, h * e : (h + 1) * e]
                for u in range(t + 1):
                    weight = probs[i, h, t, u]
                    v = qkv[i, u, values]
                    for f in range(e):
                        o[f] += weight * v[f]


@njit(nogil=True, cache=True)
def attend_backward_(probs, qkv, d_out, heads, d_probs, d_qkv, values):
    """d_probs = do_t . v_u (u <= t, else 0; over the features in index order); the v part of
    d_qkv = sum over t >= u of P_tu do_t, t ascending; values: an (e, T) workspace."""
    m, positions, width = qkv.shape
    d = width // 3
    e = d // heads
    d_qkv[:] = 0
    for i in range(m):
        for h in range(heads):
            for u in range(positions):
                for f in range(e):
                    values[f, u] = qkv[i, u, 2 * d + h * e + f]
            lower_products_(d_out[i, :, h * e : (h + 1) * e], values, d_probs[i, h])
            for u in range(positions):
                dv = d_qkv[i, u, 2 * d + h * e : 2 * d + (h + 1) * e]
                for t in range(u, positions):
                    weight = probs[i, h, t, u]
                    do = d_out[i, t, h * e : (h + 1) * e]
                    for f in range(e):
                        dv[f] += weight * do[f]


@njit(nogil=True, cache=True)
def causal_softmax_backward_(probs, d_probs):
    """d_probs = the gradient at the scores: P_tu (dP_tu - sum_u' P_tu' dP_tu'), in place."""
    m, heads, positions, _ = probs.shape
    for i in range(m):
        for h in range(heads):
            for t in range(positions):
                inner = 0.0
                for u in range(t + 1):
                    inner += np.float64(probs[i, h, t, u]) * np.float64(d_probs[i, h, t, u])
                for u in range(t + 1):
                    d_probs[i, h, t, u] = np.float64(probs[i, h, t, u]) * (
                        np.float64(d_probs[i, h, t, u]) - inner)  # fmt: skip


@njit(nogil=True, cache=True)
def scores_backward_(d_scores, qkv, heads, scale, d_qkv):
    """The q and k parts of d_qkv: dq_t = scale sum over u <= t of ds_tu k_u (u ascending),
    dk_u = scale sum over t >= u of ds_tu q_t (t ascending)."""
    m, positions, width = qkv.shape
    d = width // 3
    e = d // heads
    for i in range(m):
        for h in range(heads):
            queries, keys = slice(h * e, (h + 1) * e), slice(d + h * e, d + (h + 1) * e)
            for t in range(positions):
                dq = d_qkv[i, t, queries]
                dq[:] = 0
                for u in range(t + 1):
                    weight = d_scores[i, h, t, u]
                    k = qkv[i, u, keys]
                    for f in range(e):
                        dq[f] += weight * k[f]
                for f in range(e):
                    dq[f] *= scale
            for u in range(positions):
                dk = d_qkv[i, u, keys]
                dk[:] = 0
                for t in range(u, positions):
                    weight = d_scores[i, h, t, u]
                    q = qkv[i, t, queries]
                    for f in range(e):
                        dk[f] += weight * q[f]
                for f in range(e):
                    dk[f] *= scale


# -- float mode's attention: BLAS products per sample and head, on the heads' copies ------------


def exp_of(value):  # type: ignore[no-untyped-def]
    """exp(value) in its own float type, in the kernels (float32: `exp_float32`)."""
    return math.exp(value)


@overload(exp_of)
def _exp_of(value):  # type: ignore[no-untyped-def]
    """The kernels' exp_of: exp_float32 for a float32, else the C library's."""
    if value == types.float32:
        return lambda value: exp_float32(value)
    return lambda value: math.exp(value)


@njit(nogil=True, cache=True)
def split_heads_(rows, scale, heads_out):
    """heads_out[c, i, h, t, f] = rows[i, t, c d + h e + f] (times `scale` for c = 0): the c-th
    third's heads side by side, (parts, m, heads, T, e) of (m, T, parts d)."""
    parts, m, heads, positions, e = heads_out.shape
    d = heads * e
    for c in range(parts):
        factor = scale if c == 0 else 1.0
        for i in range(m):
            for h in range(heads):
                for t in range(positions):
                    source = rows[i, t, c * d + h * e : c * d + (h + 1) * e]
                    target = heads_out[c, i, h, t]
                    for f in range(e):
                        target[f] = source[f] * factor


@njit(nogil=True, cache=True)
def merge_heads_(heads_in, scale, rows):
    """rows[i, t, c d + h e + f] = heads_in[c, i, h, t, f] (times `scale` for c = 0): the
    inverse of split_heads_."""
    parts, m, heads, positions, e = heads_in.shape
    d = heads * e
    for c in range(parts):
        factor = scale if c == 0 else 1.0
        for i in range(m):
            for t in range(positions):
                target = rows[i, t, c * d : (c + 1) * d]
                for h in range(heads):
                    source = heads_in[c, i, h, t]
                    for f in range(e):
                        target[h * e + f] = source[f] * factor


@njit(nogil=True, cache=True)
def free_attention_(qkv_heads, probs, out_heads):
    """out_heads[i, h] = softmax(q k^T, causal) v per sample and head (q already scaled)."""
    _, m, heads, _, _ = qkv_heads.shape
    for i in range(m):
        for h in range(heads):
            np.dot(qkv_heads[0, i, h], qkv_heads[1, i, h].T, probs[i, h])
        causal_softmax_rows_(probs[i])
        for h in range(heads):
            np.dot(probs[i, h], qkv_heads[2, i, h], out_heads[i, h])


@njit(nogil=True, cache=True)
def free_attention_backward_(qkv_heads, probs, d_out_heads, d_probs, d_qkv_heads):
    """d_qkv_heads = the gradients at (scaled q, k, v) by head from d_out_heads; d_probs: a
    workspace (the gradient at the weights, then at the scores)."""
    _, m, heads, _, _ = qkv_heads.shape
    for i in range(m):
        for h in range(heads):
            np.dot(d_out_heads[i, h], qkv_heads[2, i, h].T, d_probs[i, h])  # dP = do v^T
            np.dot(probs[i, h].T, d_out_heads[i, h], d_qkv_heads[2, i, h])  # dv = P^T do
        softmax_rows_backward_(probs[i], d_probs[i])
        for h in range(heads):
            np.dot(d_probs[i, h], qkv_heads[1, i, h], d_qkv_heads[0, i, h])  # ds k
            np.dot(d_probs[i, h].T, qkv_heads[0, i, h], d_qkv_heads[1, i, h])  # ds^T q


@njit(nogil=True, cache=True, fastmath={"reassoc"})  # the row's sum in any order: it vectorises
def causal_softmax_rows_(scores):
    """Each (heads, T, T) row t: softmax over u <= t in the scores' dtype, 0 for u > t."""
    heads, positions, _ = scores.shape
    for h in range(heads):
        for t in range(positions):
            row = scores[h, t]
            top = row[0]
            for u in range(1, t + 1):
                top = max(top, row[u])
            total = row.dtype.type(0)
            for u in range(t + 1):
                row[u] = exp_of(row[u] - top)
                total += row[u]
            inverse = row.dtype.type(1) / total
            for u in range(t + 1):
                row[u] *= inverse
            row[t + 1 :] = 0


@njit(nogil=True, cache=True, fastmath={"reassoc"})  # the row's sum in any order
def softmax_rows_backward_(probs, d_probs):
    """d_probs = P (dP - sum_u P dP) row by row, in place, over the whole row (P is 0 past t)."""
    heads, positions, _ = probs.shape
    for h in range(heads):
        for t in range(positions):
            p, g = probs[h, t], d_probs[h, t]
            inner = g.dtype.type(0)
            for u in range(t + 1):
                inner += p[u] * g[u]
            for u in range(positions):
                g[u] = p[u] * (g[u] - inner)
