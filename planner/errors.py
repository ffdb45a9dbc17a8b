"""The project's own error types.

Every error a user can cause is one of these; the CLI turns them into a one-line
message and exit code 2 (bad input). Nothing here imports torch.
"""

from __future__ import annotations


class VramplanError(Exception):
    """Base class: a problem the user can fix, reported in one line."""

    exit_code = 2


class UnitError(VramplanError, ValueError):
    """A quantity with a missing, ambiguous or wrong unit ("24G", "-3k")."""


class ConfigError(VramplanError, ValueError):
    """A config.json that is malformed, truncated or missing a required field."""


class UnsupportedArchitectureError(VramplanError, ValueError):
    """A model_type this project does not know how to count."""


class ModelNotFoundError(VramplanError, LookupError):
    """A --model that is no directory, no cached hub id and no catalog name."""


class CheckpointError(VramplanError, ValueError):
    """Weights that are missing, unreadable or do not match the config."""


class ProfileError(VramplanError, ValueError):
    """A hardware profile that does not validate (file, key path, expectation)."""


class PlanError(VramplanError, ValueError):
    """A request the planner cannot honour (contradictory or impossible forced options)."""
