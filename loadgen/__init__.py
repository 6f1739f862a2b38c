"""The load generator (filled in by the serving-plane work): drives the HTTP prefill API."""
