"""`python -m bubbletea.report RUN_DIR [--out DIR]`, the same as `bubbletea report`."""

from bubbletea.report.command import main

raise SystemExit(main())
