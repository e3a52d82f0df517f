"""Benchmark clients."""
