"""The run configuration: one pydantic tree, loaded from YAML, with dotted `--set` overrides.

Every field has a description and a default that serves a first run; `ftis-engine train --dry-run` prints the
resolved tree. Errors are raised as ConfigError with a one-line message that names the field.

By concern: schema.py (the tree; member.py, data.py and swarm.py hold its largest sections; each field's own
bounds and choices), checks.py (the rules between fields), load.py (YAML, `--set`, pydantic's messages made one
line, config differences), types.py (what they share).
"""

from .checks import MAX_STEP_ROLLOUT_BYTES
from .load import (NULLS, OVERRIDE_HELP, DuplicateKeyError, _UniqueKeyLoader, apply_override, apply_value, config_differences,
                   dump_config, format_validation_error, load_config, read_yaml_mapping, validate_config,
                   value_differences)
from .data import DataSettings, RewardTerm
from .member import AdversarySettings, LoraSettings, MemberSettings, VllmSettings, WarmStartSettings
from .schema import (AlgorithmSettings, CheckpointSettings, EvalSettings, LoggingSettings, RolloutSettings, RunConfig,
                     TrainSettings)
from .swarm import MIN_LEASE_S, DefenseSettings, LatencySettings, SwarmSettings
from .types import SAFE_NAME, Beta, ConfigError, Seed, safe_path_name

__all__ = [
    "MAX_STEP_ROLLOUT_BYTES", "MIN_LEASE_S", "NULLS", "OVERRIDE_HELP", "SAFE_NAME", "AdversarySettings", "AlgorithmSettings", "Beta",
    "CheckpointSettings", "ConfigError", "DataSettings", "DefenseSettings", "DuplicateKeyError", "EvalSettings",
    "LatencySettings", "LoggingSettings", "LoraSettings", "MemberSettings", "RewardTerm", "RolloutSettings",
    "RunConfig", "Seed", "SwarmSettings", "TrainSettings", "VllmSettings", "WarmStartSettings", "_UniqueKeyLoader",
    "apply_override", "apply_value", "config_differences", "dump_config", "format_validation_error", "load_config",
    "read_yaml_mapping", "safe_path_name", "validate_config", "value_differences",
]
