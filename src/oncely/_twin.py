"""The marker of the places where an asyncio module and its generated sync twin differ.

::

    from oncely._twin import ASYNC

    if ASYNC:
        watch = asyncio.get_running_loop().create_task(...)   # the asyncio code
    else:
        pass                                                  # the sync code

``tools/unasync.py`` keeps only the ``else`` part in the sync twin; at run time, in the async
module, ``ASYNC`` is true. mypy is told so (``always_true``), and checks each side in its own
module.
"""

ASYNC = True
