"""The controller: the global view, the incident pipeline, the REST admin API (DESIGN.md sections 4, 5, 7)."""
