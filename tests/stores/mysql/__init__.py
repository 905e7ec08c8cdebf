"""MariaDB / MySQL store specifics: URLs, the table layout, InnoDB's locking (R8, R9), joining a
caller's transaction (R7), failures translated, the pool after a server restart, and races and
SIGKILL crashes with real processes.

The shared behaviour (every operation, both modes, sync and async) is the contract suite,
which runs on this store through ``tests/backends/mysql.py``; here is what is particular to a
server with row locks, REPEATABLE READ snapshots and deadlocks. Each test works on tables of
its own in the server's ``test`` database (``tests.services.MYSQL_URL``).
"""
