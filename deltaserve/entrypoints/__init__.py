"""Entrypoints that put the engine behind a network API."""
