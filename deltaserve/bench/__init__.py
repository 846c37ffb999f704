"""Benchmarks and simulators that run the engine's plain-Python parts without a model."""
