"""Gateway service: HTTP and SSE in front of the Redis bus. No torch here."""
