"""Measuring what a format costs: `minifloat compare` (train in several precisions), the
benchmarks behind `minifloat bench`, error analysis, and what the machine offers (`devices`)."""
