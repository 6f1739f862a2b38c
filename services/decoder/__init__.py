"""The decoder service: whole completions from the KV caches prefilled in the bubbles."""
