"""`python -m shared.report RUN_DIR [--out DIR]`, the same as `bubbletea report`."""

from shared.report.command import main

raise SystemExit(main())
