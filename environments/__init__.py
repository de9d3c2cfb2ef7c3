"""Lachesis environments: the trajectory data model, the rollout API and environments."""

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
    "Message",
    "ScoredData",
    "ScoredGroup",
    "ScoredTrajectory",
    "ToolCall",
    "TrajectoryError",
    "TrajectoryFlags",
]
