"""A verifiers 0.4.0 (``verifiers.v1``) environment, as a verifiers user writes one: add two
numbers with a calculator tool. Every task asks "What is 3 + 4?" (the ids differ), so a
test can steer the tiny model's calls with one regex.

Rewards (weighted, scored per trace): ``correct`` (1.0) when the final reply is "The answer
is 7."; ``used_tool`` (0.5) when a tool result is 7. The env caps episodes at 3 turns
(``agent.max_turns``)."""

import verifiers.v1 as vf


class Calc(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"  # the model sees calc_add

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddData(vf.TaskData):
    answer: int


class AddTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == f"The answer is {self.data.answer}.")

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.content == str(self.data.answer) for m in trace.tool_messages))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class AddConfig(vf.TasksetConfig):
    task: AddTaskConfig = AddTaskConfig()
    num_tasks: int = 16


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield AddTask(AddData(id=f"add-{i}", prompt="What is 3 + 4?", answer=7,
                                  system_prompt="Call calc_add, then say 'The answer is N.'"),
                          self.config.task)


class AddEnvConfig(vf.SingleAgentEnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=3)


class AddEnv(vf.Env[AddEnvConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["AddEnv", "AddTaskset"]
