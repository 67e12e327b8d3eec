"""Benchmarks that print predicted (zoo.math) next to measured."""
