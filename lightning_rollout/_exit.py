"""Close running loops and policies at interpreter exit, before Python finalizes.

A daemon thread still inside a torch or numpy call while the interpreter tears
itself down can abort the process ("terminate called without an active
exception"). :func:`close_at_exit` registers an object with a ``close()``
method (held weakly); one ``atexit`` hook closes every registered object that
is still alive, which stops and joins its threads first.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakSet[_Closable] = weakref.WeakSet()


def close_at_exit(obj: _Closable) -> None:
    """Close ``obj`` at interpreter exit if it is still alive then (weak reference)."""
    _LIVE.add(obj)


@atexit.register
def _close_live() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception:  # exiting: nothing to report to
            pass
