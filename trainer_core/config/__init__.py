"""Pydantic configuration of a post-training pipeline.

:class:`PipelineConfig` (``pipeline.py``) holds the stage list and every section: the
pipeline-wide ones (``sections.py``: storage, tracking, data, tokenizer, model, launch), the
backend (``backend.py``) and each stage's own (``stages.py``, ``rewards.py``, ``distill.py``).
:func:`load_config` reads YAML (any fsspec URI), applies ``key.path=value`` overrides and
validates once; errors name the field path.
"""

from trainer_core.config.backend import BACKENDS, BackendConfig, BackendOverride
from trainer_core.config.base import ConfigBase, config_hash
from trainer_core.config.distill import DistillConfig, TeacherConfig
from trainer_core.config.pipeline import (
    PipelineConfig,
    apply_overrides,
    config_value,
    load_config,
    parse_override,
    resolve_local_root,
)
from trainer_core.config.sections import (
    DataConfig,
    DataSource,
    LaunchConfig,
    LoraConfig,
    LoraOverride,
    ModelConfig,
    ModelInit,
    StorageConfig,
    SweepConfig,
    SyntheticConfig,
    TokenizerConfig,
    TrackingConfig,
    check_grid,
)
from trainer_core.config.generation import (
    EnvironmentConfig,
    GenerationConfig,
    RolloutGenerationConfig,
    VLLMConfig,
    SampledGenerationConfig,
)
from trainer_core.config.rewards import RewardConfig
from trainer_core.config.evaluation import EvaluateConfig, ScoreConfig
from trainer_core.config.stages import (
    DPOConfig,
    GRPOConfig,
    KTOConfig,
    MoEConfig,
    OptimizerStageConfig,
    PPOConfig,
    PretrainConfig,
    RewardModelConfig,
    RLStageConfig,
    RouterTemperatureConfig,
    SFTConfig,
    SupervisedStageConfig,
    TrainStageConfig,
)

__all__ = [
    "BACKENDS",
    "BackendConfig",
    "BackendOverride",
    "ConfigBase",
    "DPOConfig",
    "DataConfig",
    "DataSource",
    "DistillConfig",
    "TeacherConfig",
    "EnvironmentConfig",
    "EvaluateConfig",
    "GRPOConfig",
    "GenerationConfig",
    "KTOConfig",
    "MoEConfig",
    "OptimizerStageConfig",
    "RouterTemperatureConfig",
    "LaunchConfig",
    "LoraConfig",
    "LoraOverride",
    "ModelConfig",
    "ModelInit",
    "PPOConfig",
    "PipelineConfig",
    "PretrainConfig",
    "RLStageConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutGenerationConfig",
    "VLLMConfig",
    "SFTConfig",
    "SupervisedStageConfig",
    "SampledGenerationConfig",
    "ScoreConfig",
    "StorageConfig",
    "SweepConfig",
    "SyntheticConfig",
    "TokenizerConfig",
    "TrackingConfig",
    "TrainStageConfig",
    "apply_overrides",
    "check_grid",
    "config_value",
    "config_hash",
    "load_config",
    "parse_override",
    "resolve_local_root",
]
