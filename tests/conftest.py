"""Fixtures for the flashckpt tests (defined in fchelpers, which test files import directly)."""

from fchelpers import agent, fc_env

__all__ = ["agent", "fc_env"]
