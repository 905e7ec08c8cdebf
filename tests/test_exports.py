"""The public door: one import, sorted exports, sync and async twins with the same methods."""

from __future__ import annotations

import inspect
import types

import oncely
import oncely.testing
import oncely.testing.contract


def test_all_is_sorted_and_importable() -> None:
    assert oncely.__all__ == sorted(oncely.__all__)
    for name in oncely.__all__:
        assert getattr(oncely, name) is not None, name


def test_dir_lists_the_api_and_the_submodules_only() -> None:
    """``dir(oncely)`` (what a REPL completes) is ``__all__`` plus the submodules imported so
    far: a user found ``TYPE_CHECKING``, ``importlib`` and ``warnings`` there, which are not
    oncely's API, and no ``AsyncSQLiteStore``, which is imported on first use."""
    names = dir(oncely)
    assert set(oncely.__all__) <= set(names)
    public = {n for n in names if not n.startswith("_")}
    submodules = {
        n
        for n in public
        if isinstance(getattr(oncely, n), types.ModuleType)
        and getattr(oncely, n).__name__ == f"oncely.{n}"
    }
    assert public - submodules == {n for n in oncely.__all__ if not n.startswith("_")}


def _public_methods(cls: type) -> set[str]:
    # The whole MRO: the inbox and the contract suite are assembled from parts in other modules.
    members = {n: v for klass in reversed(cls.__mro__[:-1]) for n, v in vars(klass).items()}
    return {n for n, v in members.items() if not n.startswith("_") and callable(v)} | {
        n for n, v in members.items() if isinstance(v, property)
    }


def test_sync_and_async_twins_offer_the_same_methods() -> None:
    pairs = [
        (oncely.Inbox, oncely.AsyncInbox),
        (oncely.MemoryStore, oncely.AsyncMemoryStore),
        (oncely.SQLiteStore, oncely.AsyncSQLiteStore),
        (oncely.DynamoDBStore, oncely.AsyncDynamoDBStore),
        (oncely.testing.contract.StoreContract, oncely.testing.contract.AsyncStoreContract),
    ]
    for sync, asynchronous in pairs:
        sync_names = {
            n.replace("close", "aclose") if n == "close" else n for n in _public_methods(sync)
        }
        assert sync_names == _public_methods(asynchronous), (sync, asynchronous)
        for name in _public_methods(asynchronous):
            method = getattr(asynchronous, name)
            if inspect.isfunction(method) and name.startswith("test_"):
                assert inspect.iscoroutinefunction(method)


def test_stores_satisfy_their_protocols(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(oncely.MemoryStore(), oncely.Store)
    assert not isinstance(oncely.MemoryStore(), oncely.TransactionalStore)
    sqlite = oncely.SQLiteStore(tmp_path / "o.db")
    assert isinstance(sqlite, oncely.TransactionalStore)
    assert isinstance(oncely.AsyncSQLiteStore(tmp_path / "o.db"), oncely.AsyncTransactionalStore)
    assert isinstance(oncely.AsyncMemoryStore(), oncely.AsyncStore)


def test_no_public_name_shadows_a_builtin_except_open() -> None:
    import builtins

    shadowing = {n for n in oncely.__all__ if hasattr(builtins, n)}
    assert shadowing == {"open"}  # oncely.open(url), never imported bare in oncely's own code


def test_errors_form_one_tree() -> None:
    for name in oncely.errors.__all__:
        assert issubclass(getattr(oncely.errors, name), oncely.OncelyError), name


async def test_an_async_inbox_closes_at_the_end_of_an_async_with_block() -> None:
    store = oncely.AsyncMemoryStore()
    async with oncely.AsyncInbox(store, consumer="c") as inbox:
        assert (await inbox.handle("k", 1, _one)).outcome is oncely.Outcome.PROCESSED
    assert (await oncely.AsyncInbox(store, consumer="c").handle("k", 1, _one)).outcome == (
        oncely.Outcome.DUPLICATE
    )  # the store is the caller's: still open
    with oncely.Inbox(oncely.MemoryStore(), consumer="c") as sync_inbox:
        assert sync_inbox.handle("k", 1, lambda p: p).outcome is oncely.Outcome.PROCESSED


async def _one(payload: int) -> int:
    return payload
