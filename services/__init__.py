"""One package per service; no service imports another (shared code lives in `shared`)."""
