"""Progress bars (tqdm, on stderr) and notes printed between them.

tqdm is imported on first use: every ``kvlookup`` command builds the ``bench`` parser, and tqdm
pulls in multiprocessing, whose finalizers cost a controller ~0.7 s at exit on a busy box."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tqdm import tqdm

T = TypeVar("T")
ENABLED = sys.stderr.isatty()


def iterate(items: Iterable[T], label: str) -> Iterator[T]:
    """Iterate with a bar (only when stderr is a terminal, so logs stay clean)."""
    from tqdm import tqdm

    return iter(tqdm(items, desc=label, leave=False, disable=not ENABLED, dynamic_ncols=True))


def bar(total: int, label: str) -> tqdm:
    """A bar of ``total`` units; call ``update(n)`` and ``close()``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, leave=False, disable=not ENABLED, unit_scale=True, dynamic_ncols=True)


def note(text: str) -> None:
    """Print a line without breaking a running bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)
