"""`python -m kobold_backend.cli`: the same as the `kobold-backend` command."""

import sys

from kobold_backend.cli.main import main

sys.exit(main())
