from __future__ import annotations

import oncely

from . import Backend

BACKEND = Backend(
    name="memory",
    make_sync=lambda scope, clock: oncely.MemoryStore(clock=clock),
    make_async=lambda scope, clock: oncely.AsyncMemoryStore(clock=clock),
)
