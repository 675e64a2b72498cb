"""Signal handlers installed for the length of a block, the previous ones restored after it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def handling(
    signals: Iterable[signal.Signals], handler: Callable[[int, Any], None]
) -> Iterator[None]:
    """Call `handler` on each of `signals` inside the block; restore the old handlers after."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
