"""``python -m isthmus`` is the same as the ``isthmus`` command."""

from isthmus.deploy.cli import main

raise SystemExit(main())
