"""End-to-end benchmarks behind ``sluice bench``: whole training runs compared side by side."""
