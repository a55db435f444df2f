"""``python -m megamoe``: the same command line as the ``megamoe`` console script."""

from .tools.cli import main

raise SystemExit(main())
