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
    """A --model that is no directory, no cached hub id, no catalog name and no hub repo."""


class AmbiguousModelError(ModelNotFoundError):
    """A --model that names several catalog models: the hub is not asked."""


class CheckpointError(VramplanError, ValueError):
    """Weights that are missing, unreadable or do not match the config."""


class HubError(VramplanError):
    """The Hugging Face hub answered with an error that is not one of those below."""


class HubAccessError(HubError):
    """A gated or private repo the token (HF_TOKEN) gives no access to."""


class HubUnreachableError(HubError):
    """No network, a hub endpoint that does not answer, or offline mode with nothing cached."""


class ProfileError(VramplanError, ValueError):
    """A hardware profile that does not validate (file, key path, expectation)."""


class PlanError(VramplanError, ValueError):
    """A request the planner cannot honour (contradictory or impossible forced options)."""
