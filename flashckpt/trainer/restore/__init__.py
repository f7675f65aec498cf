"""Restore: one pipeline run collectively by every rank on entry (plan, read from a source, fit to
this run's layout, apply), with one module per concern."""
