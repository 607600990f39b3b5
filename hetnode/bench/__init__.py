"""Benchmarks behind `hetnode bench ...`: side-by-side runs that write JSON + PNG results."""
