"""``python -m optkit``: the same as the ``optkit`` command."""

from .cli import main

raise SystemExit(main())
