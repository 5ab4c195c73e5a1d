"""Benchmarks: each prints a table and writes JSON under --out."""
