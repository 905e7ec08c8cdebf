"""The pure core: models, rules and decisions. No I/O, no threads, no asyncio; time is a value."""
