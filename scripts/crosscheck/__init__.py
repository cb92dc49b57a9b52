"""The steps of scripts/crosscheck_official.py (its docstring says what is compared and how)."""
