"""Lachesis environments: the trajectory data model, the rollout API, the env framework
(``BaseEnv``, ``TurnLevelRewardMixin``, tools) and the environments shipped with it."""

from environments.agent_loop import AssistantTurn, RolloutState
from environments.base import BaseEnv, EnvConfig, RewardError, TurnLevelRewardMixin
from environments.rewards import RewardFunction, reward_function, rollout_state
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
    "RewardError",
    "RewardFunction",
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
    "reward_function",
    "rollout_state",
    "tool",
]
