"""Lachesis environments: the trajectory data model, the rollout API, the env framework
(``BaseEnv``, ``TurnLevelRewardMixin``, tools) and the environments shipped with it."""

from environments.framework.base import (
    BaseEnv,
    EnvConfig,
    RewardError,
    TurnLevelRewardMixin,
)
from environments.framework.rewards import (
    RewardFunction,
    reward_function,
    rollout_state,
)
from environments.framework.tools import Tool, ToolError, tool
from environments.rollout import AssistantTurn, Rollout, RolloutState
from environments.trajectory import (
    Message,
    ScoredData,
    ScoredDataGroup,
    ScoredDataItem,
    ScoredGroup,
    ScoredTrajectory,
    ToolCall,
    TrajectoryError,
    TrajectoryFlags,
)

__all__ = [
    "AssistantTurn",
    "BaseEnv",
    "EnvConfig",
    "Message",
    "RewardError",
    "RewardFunction",
    "Rollout",
    "RolloutState",
    "ScoredData",
    "ScoredDataGroup",
    "ScoredDataItem",
    "ScoredGroup",
    "ScoredTrajectory",
    "Tool",
    "ToolCall",
    "ToolError",
    "TrajectoryError",
    "TrajectoryFlags",
    "TurnLevelRewardMixin",
    "reward_function",
    "rollout_state",
    "tool",
]
