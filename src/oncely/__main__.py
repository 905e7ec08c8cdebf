"""``python -m oncely``: the same as the ``oncely`` executable."""

from oncely.cli import main

main()
