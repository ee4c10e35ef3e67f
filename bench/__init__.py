"""Benchmarks for lancet-rt: commands that print a table and append JSON rows."""
