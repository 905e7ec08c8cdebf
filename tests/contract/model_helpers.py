"""What the reference model's state machine (test_model_stateful.py) is built on.

The pools that operations draw from (small, so that they collide) and the clock steps that land
on and around lease and retention boundaries; :class:`Answer`, one call's reply in a form that
compares across store and model; :class:`Blocking`, which drives an async store call by call;
and :class:`StoreAndModel`, the machine's base: a fresh store, the model and one clock per
example, and the comparison of their answers. The rules are in model_claims.py (claims and
takeovers) and test_model_stateful.py (fenced writes, reads, upkeep and clock steps).
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine

from oncely import FakeClock, LeaseLost
from oncely._core.table import RecordTable

CONSUMERS = ("billing", "shipping")
KEYS = ("order-1", "order-2", "order-3")
FINGERPRINTS = (None, "v1:aaaa", "v1:bbbb")
LEASES = (1_000, 5_000)
KEEPS = (3_000, 60_000)  # 3s keep under a 5s lease: a record must still outlive its lease
# Clock steps: the lease and keep values above and their neighbours, short steps that leave a
# lapsed lease unexpired (the takeover window), and long jumps past every retention.
STEPS = st.sampled_from(
    [0, 1, 999, 1_000, 1_001, 2_999, 3_000, 3_001, 4_999, 5_000, 5_001, 59_999, 60_000, 60_001]
) | st.integers(min_value=0, max_value=6_000)
LONG_STEPS = st.integers(min_value=6_000, max_value=120_000)
RESULTS = st.sampled_from([None, b"", b'{"ok":true}', b"\x00\xff"])
NOTES = st.sampled_from([None, "completed by reconciler"])
ERRORS = st.sampled_from(["poison message", "boom"])
BOGUS = "tok-never-issued"


class Issued(NamedTuple):
    """A token some claim carried, and the record it was for."""

    consumer: str
    key: str
    token: str


consumers = st.sampled_from(CONSUMERS)
keys = st.sampled_from(KEYS)
fingerprints = st.sampled_from(FINGERPRINTS)
tokens = Bundle("tokens")  # the Issued tokens of claims and takeovers, for fenced writes to aim


class Answer(NamedTuple):
    """What one call gave back, in a form that compares across store and model."""

    value: object
    lost: bool = False
    message: str | None = None


def _answer(call: Callable[[], object]) -> Answer:
    try:
        return Answer(call())
    except LeaseLost as exc:
        return Answer(exc.current, lost=True, message=str(exc))


StoreFactory = Callable[[Path, FakeClock], Any]


class Blocking:
    """An async store driven call by call on a private event loop, so the same machine (and
    the same model) checks the async twin, whose I/O layer is written by hand."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._runner = asyncio.Runner()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        return lambda *args, **kwargs: self._runner.run(attr(*args, **kwargs))

    @contextmanager
    def transaction(self, *, claim_first: bool = False) -> Iterator[Any]:
        block = self._store.transaction(claim_first=claim_first)
        tx = self._runner.run(block.__aenter__())
        try:
            yield tx
        except BaseException as exc:
            if not self._runner.run(block.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self._runner.run(block.__aexit__(None, None, None))

    def close(self) -> None:
        try:
            self._runner.run(self._store.aclose())
        finally:
            self._runner.close()


class StoreAndModel(RuleBasedStateMachine):
    """One example: a fresh store on a fresh temporary directory, the model, one clock."""

    factory: StoreFactory
    transactional: bool

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.model = RecordTable()
        self.directory = Path(tempfile.mkdtemp(prefix="oncely-model-"))
        self.store = type(self).factory(self.directory, self.clock)
        self.issued = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _token(self) -> str:
        self.issued += 1
        return f"tok-{self.issued}"

    def _same(
        self, op: str, store_call: Callable[[], object], model_call: Callable[[], object]
    ) -> None:
        got = _answer(store_call)
        expected = _answer(model_call)
        assert got == expected, f"{op}: store answered {got}, model {expected}"

    def _current_token(self, consumer: str, key: str) -> str | None:
        # The token the record carries, even when it has expired and awaits a purge: the right
        # token on a record that no longer counts is a case of its own.
        record = self.model.records.get((consumer, key))
        return None if record is None else record.token
