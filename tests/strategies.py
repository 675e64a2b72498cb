"""Hypothesis strategies shared by the allreduce tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def world_and_shape(draw: st.DrawFn) -> tuple[int, tuple[int, ...]]:
    """A number of thread ranks and a buffer shape, with lengths around multiples of P."""
    size = draw(st.integers(1, 12))
    length = st.integers(0, 3 * size + 2)  # 0, 1, < P, = P, not divisible by P, ...
    shape = draw(
        st.one_of(
            length.map(lambda n: (n,)),
            st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),  # multi-dim, 0-d
        )
    )
    return size, shape
