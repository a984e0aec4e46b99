"""The wire schema between sites (``.proto`` files) and the Python code generated from it."""
