"""``python -m jaxfog.cli``: the ``jaxfog`` command."""

import sys

from jaxfog.cli import main

if __name__ == "__main__":
    sys.exit(main())
