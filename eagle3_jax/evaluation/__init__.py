"""Speculative-decoding evaluation: Spec-Bench / MT-bench / GSM8K questions, metrics, runner."""
