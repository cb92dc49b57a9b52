"""`python -m eagle3_jax COMMAND ...`: see eagle3_jax/cli/__init__.py for the commands."""

import sys

from eagle3_jax.cli import main

sys.exit(main())
