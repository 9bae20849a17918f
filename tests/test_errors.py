"""Tests moved from test_reliability.py."""
import clover_lab
from clover_lab import (
    CheckpointError,
    CloverError,
    GenerationError,
    HookError,
    SettingsError,
)


def test_every_error_here_is_a_clover_error():
    for cls in (CheckpointError, GenerationError, HookError, SettingsError, clover_lab.ConfigError,
                clover_lab.CacheFullError, clover_lab.GrammarError):
        assert issubclass(cls, CloverError)
    assert issubclass(SettingsError, ValueError) and issubclass(SettingsError, TypeError)
