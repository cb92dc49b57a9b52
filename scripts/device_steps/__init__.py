"""The steps of scripts/device_job.py (its docstring says which module holds which)."""
