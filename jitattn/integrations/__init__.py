"""Integrations of jitattn with other libraries (imported on demand)."""
