"""embed(d): token ids -> vectors, a token embedding plus learned positions.

For a sample of T token ids x_t: y_t = tok.weight[x_t] + pos.weight[t], as the sum of two
torch.nn.Embedding modules `tok` (V, d) and `pos` (T, d), V the loss's classes (the vocabulary).
Backward: the token embedding's gradient is a scatter-add by token id, written as the sum over
positions of one_hot(x_t) dy_t^T (one product, so every mode sums it as it sums a dense layer's
weight); the positions' gradient is the sum over the samples of dy.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from syncsgd.nn.layers.base import Layer, Param, Primitives, Shape


class Embed(Layer):
    """Token and position embeddings of a sequence of token ids (the first layer)."""

    kind = "embed"
    signature = "embed(d)"
    reads_tokens = True

    def __init__(self, d: int) -> None:
        super().__init__()
        if d < 1:
            raise ValueError(f"embed({d}): the width must be >= 1")
        self.d = d
        self.vocabulary = 0

    def output_shape(self, in_shape: Shape, outputs: int, last: bool) -> Shape:
        """(T, d) of T token ids."""
        if self.position != 0 or len(in_shape) != 1:
            raise ValueError("embed reads a sequence of token ids: it must be the first layer, "
                             "on token data (--data PATH.txt or numbers-to-words)")  # fmt: skip
        self.vocabulary = outputs
        return (in_shape[0], self.d)

    def params(self) -> list[Param]:
        """tok.weight (V, d) and pos.weight (T, d), both N(0, 1) as torch.nn.Embedding starts."""
        return [Param("tok.weight", (self.vocabulary, self.d), "normal", 1.0),
                Param("pos.weight", (self.in_shape[0], self.d), "normal", 1.0)]  # fmt: skip

    def forward_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                 y: np.ndarray) -> None:  # fmt: skip
        """y[i, t] = round(tok[x[i, t]] + pos[t])."""
        bad = embed_(x, p["tok.weight"], p["pos.weight"], y)
        if bad >= 0:
            raise ValueError(f"embed: token id {x.reshape(-1)[bad]} is not in the vocabulary of "
                             f"{self.vocabulary}")  # fmt: skip
        nx.round_(y)

    def backward_sums_(self, nx: Primitives, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                       x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> None:  # fmt: skip
        """g.tok += one_hot(x)^T dy over every position, g.pos += the sum of dy over samples."""
        m, positions = x.shape
        one_hot = self.workspaces(nx).get("one_hot", (m * positions, self.vocabulary), dy.dtype)
        one_hot_(x.reshape(-1), one_hot)
        nx.outer_sum_(self.position, one_hot, dy.reshape(-1, self.d), g["tok.weight"], positions)
        per_sample = dy.reshape(m, positions * self.d)  # one row a sample: (t, j) its columns
        nx.column_sum_(self.position, per_sample, g["pos.weight"].reshape(-1))

    def backward_input_(self, nx: Primitives, p: dict[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:  # fmt: skip
        """Token ids have no gradient (the first layer: never called)."""
        dx[...] = 0

    def scratch_bytes(self, m: int, itemsize: int) -> int:
        """The one-hot rows of the batch's tokens."""
        return m * self.in_shape[0] * self.vocabulary * itemsize

    def inner_size(self) -> int:
        """The one-hot rows of its T tokens."""
        return self.in_shape[0] * self.vocabulary

    def model_width(self) -> int:
        """d."""
        return self.d

    def describe(self) -> str:
        """embed(d)."""
        return f"embed({self.d})"


@njit(nogil=True, cache=True)
def embed_(x, tok, pos, y):
    """y[i, t] = tok[x[i, t]] + pos[t]; -1, or the flat index of the first id out of range."""
    m, positions = x.shape
    vocabulary, width = tok.shape
    for i in range(m):
        for t in range(positions):
            token = int(x[i, t])
            if token < 0 or token >= vocabulary or token != x[i, t]:
                return i * positions + t
            for j in range(width):
                y[i, t, j] = tok[token, j] + pos[t, j]
    return -1


@njit(nogil=True, cache=True)
def one_hot_(ids, out):
    """out[r] = the one-hot row of token ids[r]."""
    out[:] = 0
    for r in range(ids.size):
        out[r, int(ids[r])] = 1
