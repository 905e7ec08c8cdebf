"""PostgreSQL-specific behaviour: URLs, names, errors, the snapshot trap, round trips, pools that
survive a server restart, races and SIGKILLs across real processes.

Every test works on tables of its own (``oncely_t_<unique>``) and drops them, so these tests
can share the server with others. The whole contract suite runs on this store through
``tests/backends/postgres.py``; here is what only PostgreSQL has.
"""
