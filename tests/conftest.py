"""Fixtures for the flashckpt tests (defined in fchelpers, which test files import directly)."""

from fchelpers import agent, fc_env, fc_env_private

__all__ = ["agent", "fc_env", "fc_env_private"]
