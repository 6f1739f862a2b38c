"""`python -m loadgen`: the same as the `loadgen` command."""

import sys

from loadgen.cli import main

sys.exit(main())
