"""A verifiers taskset whose task needs a container: Lachesis refuses it with a clear error."""

import verifiers.v1 as vf


class BoxTask(vf.Task[vf.TaskData]):
    NEEDS_CONTAINER = True

    @vf.reward
    async def passed(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self):
        yield BoxTask(vf.TaskData(prompt="Fix the repository."))


__all__ = ["BoxTaskset"]
