"""``python -m hf_memstack.cli``: the ``hf-memstack`` command."""

from .main import main

raise SystemExit(main())
