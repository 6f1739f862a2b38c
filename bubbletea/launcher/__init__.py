"""Running the system as local processes: the service table, process supervision, the demo."""
