"""The asyncio implementation: the source from which ``oncely._sync`` is generated."""
