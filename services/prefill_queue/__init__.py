"""The HTTP front door for prefill requests (aiohttp)."""
