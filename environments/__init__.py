"""Lachesis environments: the trajectory data model, the rollout API, the env framework
(``BaseEnv``, ``TurnLevelRewardMixin``, tools) and the environments shipped with it."""

from environments.agent_loop import AssistantTurn, RolloutState
from environments.base import BaseEnv, EnvConfig, TurnLevelRewardMixin
from environments.tools import Tool, ToolError, tool
from environments.trajectory import (
    Message,
    ScoredData,
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
    "RolloutState",
    "ScoredData",
    "ScoredGroup",
    "ScoredTrajectory",
    "Tool",
    "ToolCall",
    "ToolError",
    "TrajectoryError",
    "TrajectoryFlags",
    "TurnLevelRewardMixin",
    "tool",
]
