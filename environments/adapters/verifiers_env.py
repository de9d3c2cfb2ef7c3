"""verifiers environments (verifiers 0.4.0, its ``verifiers.v1`` API): ``lachesis env serve
verifiers:ID``.

The env loads the way verifiers loads it,
``verifiers.v1.load_environment(verifiers.v1.resolve_env_config({"taskset": {"id": ID},
...}))``: ID is an importable module whose ``__all__`` holds one ``Taskset`` subclass (and
optionally an ``Env``). Lachesis then plays its tasks with its own token-in/token-out agent
loop (not a verifiers harness behind an interception proxy: the loop already keeps the
exact sampled ids and logprobs, and needs neither ``uv`` nor a sandbox runtime):

* items are the taskset's tasks, in ``load()`` order, over and over;
* the chat starts from the task's ``system_prompt`` and ``prompt``;
* the tools are the task's ``Toolset`` servers (and the taskset's shared ones), each a real
  MCP server built as verifiers builds it (``Toolset.register`` on an ``MCPServer``),
  reached through MCP's own client in-process, or at the toolset's ``url`` when its config
  names one. The model sees ``<prefix>_<tool>``, as under verifiers' harnesses; a tool
  error comes back to the model as the tool result;
* the turn cap is the env's ``config.agent.max_turns`` (Lachesis's ``max_turns`` when the
  env leaves it unset);
* the outcome is ``await task.score(trace)``'s weighted sum (``trace.reward``), on a
  verifiers ``Trace`` holding the episode's messages; each reward and metric is kept in
  the trajectory's metrics (``reward/NAME``, ``metric/NAME``).

verifiers scores whole traces only. With ``per_turn_scores``, turn ``k``'s score is the
same ``task.score`` of the trace cut after turn ``k`` (its assistant message and its tool
results): "the reward up to turn k". The last turn's score is the outcome. It is
meaningful when the env's rewards read something a partial trace already has (a tool
result holding the answer, a well-formed call); a reward that reads only the final reply
scores every earlier turn as if it were the answer (docs/adapters.md).

Nothing of verifiers' cloud is used: no inference client (vLLM serves the policy), no
runtime (Prime, Docker, Modal), no tunnel, no upload. What this adapter cannot do yet
raises a clear error at start (a task that needs a container, a reward that needs a
runtime, task ``setup``/``finalize`` hooks, multi-agent envs).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
from typing import Any

from pydantic import Field, create_model

from environments.framework.agent_loop import run_agent_loop
from environments.framework.base import BaseEnv, EnvConfig, RewardError
from environments.framework.tools import Tool, ToolError
from environments.rollout import Rollout


class VerifiersEnvConfig(EnvConfig):
    """Settings of a verifiers env run by Lachesis (``verifiers:ID`` sets ``taskset_id``)."""

    taskset_id: str = ""
    """The verifiers taskset id: an importable module whose ``__all__`` holds one
    ``Taskset`` subclass (and optionally an ``Env``)."""
    verifiers_config: dict[str, Any] = Field(default_factory=dict)
    """More of the verifiers env config, as ``resolve_env_config`` reads it, e.g.
    ``{"taskset": {"num_tasks": 50}, "agent": {"max_turns": 6}}`` (``taskset.id`` is
    ``taskset_id``)."""
    per_turn_scores: bool = False
    """Score each turn with the env's rewards on the trace cut after that turn (the
    reward up to turn k); off: one score per trajectory, the outcome."""
    tool_timeout_s: float = Field(default=60.0, gt=0)
    """How long one tool call may take."""


def _require_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ImportError("verifiers environments need the verifiers package: "
                          "pip install 'lachesis-rl[verifiers]' "
                          f"(verifiers 0.4.0) ({error})") from None
    return vf


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


class VerifiersEnv(BaseEnv):
    """A verifiers taskset's tasks, played by the policy through the agent loop."""

    name = "verifiers"
    config_class = VerifiersEnvConfig

    def __init__(self, config: VerifiersEnvConfig | None = None):
        super().__init__(config)
        if not self.config.taskset_id:
            raise ValueError("verifiers: set `taskset_id` (lachesis env serve verifiers:ID)")
        self.vf = _require_verifiers()
        vf = self.vf
        raw = {**self.config.verifiers_config}
        raw["taskset"] = {**raw.get("taskset", {}), "id": self.config.taskset_id}
        self.vf_env = vf.load_environment(vf.resolve_env_config(raw))
        agents = {name: value for name, value in self.vf_env.config
                  if isinstance(value, vf.AgentConfig)}
        if len(agents) != 1:
            raise ValueError(f"verifiers env {type(self.vf_env).__name__} has "
                             f"{len(agents)} agent roles ({', '.join(agents)}); only "
                             "single-agent envs run in Lachesis so far")
        self.agent_config = next(iter(agents.values()))
        self.max_turns = self.agent_config.max_turns or self.config.max_turns
        """The env's ``config.agent.max_turns``, else Lachesis's ``max_turns``."""
        self._tasks = None
        self._checked: set[type] = set()
        self._shared_stack = contextlib.AsyncExitStack()
        self._shared_tools: list[Tool] = []

    def scores_each_turn(self) -> bool:
        return self.config.per_turn_scores

    # -- items ---------------------------------------------------------------------------
    async def setup(self) -> None:
        taskset = self.vf_env.taskset
        first = next(iter(taskset.take(1)), None)
        if first is None:
            raise ValueError(f"verifiers taskset {self.config.taskset_id!r} has no tasks")
        self._check(first)  # a taskset yields one task type: refuse it before any rollout
        for toolset in type(taskset).toolsets(taskset.config):
            self._shared_tools += await self._shared_stack.enter_async_context(
                self._served(toolset, task=None, trace=None))

    async def close(self) -> None:
        await self._shared_stack.aclose()
        await super().close()

    def _task_stream(self):
        taskset = self.vf_env.taskset
        if not taskset.bounded:
            return iter(taskset)
        return itertools.chain.from_iterable(iter(taskset) for _ in itertools.count())

    async def get_next_item(self) -> Any:
        if self._tasks is None:
            self._tasks = self._task_stream()
        task = next(self._tasks, None)
        if task is None:
            raise ValueError(f"verifiers taskset {self.config.taskset_id!r} has no tasks")
        self._check(task)
        return task

    def item_id(self, item: Any) -> str:
        data = item.data
        return str(data.id if data.id is not None else data.idx)

    def _check(self, task: Any) -> None:
        """Refuse, once per task class, what the adapter cannot run yet."""
        cls = type(task)
        if cls in self._checked:
            return
        vf = self.vf
        problems = []
        if cls.NEEDS_CONTAINER:
            problems.append("it needs a container (NEEDS_CONTAINER)")
        for hook in ("setup", "finalize", "stage_verifier"):
            if getattr(cls, hook) is not getattr(vf.Task, hook):
                problems.append(f"it overrides Task.{hook} (runtime hooks are not run)")
        for fn in task.hooks("reward") + task.hooks("metric"):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                problems.append(f"{fn.__name__} needs a runtime")
        if task.config.judges:
            problems.append("it plugs judges (they call a model of their own)")
        if problems:
            raise ValueError(f"verifiers task {cls.__name__} cannot run in Lachesis yet: "
                             + "; ".join(problems))
        self._checked.add(cls)

    def prompt_messages(self, item: Any) -> list[dict[str, Any]]:
        data = item.data
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if data.prompt is None:
            raise ValueError(f"task {self.item_id(item)} has no prompt (a user-opened "
                             "conversation needs a user agent, not supported yet)")
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            for message in data.prompt:
                message = message.model_dump(exclude_none=True)
                content = message.get("content")
                if isinstance(content, list):
                    if any(part.get("type") != "text" for part in content):
                        raise ValueError(f"task {self.item_id(item)}: its prompt has image "
                                         "parts; only text runs in Lachesis so far")
                    message["content"] = _message_text(content)
                messages.append(message)
        return messages

    # -- tools ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _served(self, toolset: Any, *, task: Any, trace: Any):
        """The tools of one verifiers ``Toolset``: its MCP server, built as verifiers'
        server process builds it (``setup``, ``setup_task``, ``register``), reached with
        MCP's client in-process (or its ``url``), as Lachesis tools ``<prefix>_<tool>``."""
        from mcp import Client
        from mcp.server.mcpserver import MCPServer
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

        vf = self.vf
        prefix = toolset.server_name
        url = getattr(toolset.config, "url", None)
        async with contextlib.AsyncExitStack() as stack:
            if url:
                target = url
            else:
                if toolset._state_cls is not vf.State:
                    # verifiers syncs a toolset's State with the rollout over an HTTP
                    # channel; in-process the toolset reads and writes the trace's own.
                    if trace is None or not isinstance(trace.state, toolset._state_cls):
                        raise ValueError(
                            f"toolset {type(toolset).__name__}: its State "
                            f"{toolset._state_cls.__name__} is not the task's State "
                            "(or the toolset is shared by the taskset): not supported yet")

                    async def pull_state(state=trace.state):
                        return state

                    toolset._pull_state = pull_state
                stack.push_async_callback(toolset._exit_stack.aclose)
                await toolset.setup()
                if task is not None:
                    await toolset.setup_task(task)
                target = MCPServer(prefix or type(toolset).__name__)
                toolset.register(target)
            client = await stack.enter_async_context(Client(target))
            listed = await client.list_tools()

            def as_tool(mcp_tool) -> Tool:
                async def call(**arguments: Any) -> str:
                    result = await client.call_tool(mcp_tool.name, arguments)
                    text = mcp_content_to_chat_content(result.content)
                    text = text if isinstance(text, str) else json.dumps(text)
                    if result.is_error:
                        raise ToolError(text)
                    return text

                full = f"{prefix}_{mcp_tool.name}" if prefix else mcp_tool.name
                schema = dict(mcp_tool.input_schema or {"type": "object", "properties": {}})
                schema.setdefault("type", "object")
                return Tool(full, mcp_tool.description or "", schema, call,
                            timeout_s=self.config.tool_timeout_s)

            yield [as_tool(t) for t in listed.tools]

    # -- rollouts ------------------------------------------------------------------------
    def _new_trace(self, task: Any) -> Any:
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                    hash=task.hash),
                     agent=AgentInfo(config=self.agent_config),
                     state=state_cls(type(task))())

    async def collect_trajectory(self, item: Any, *, evaluation: bool = False) -> Rollout:
        trace = self._new_trace(item)
        async with contextlib.AsyncExitStack() as stack:
            tools = list(self._shared_tools)
            for toolset in type(item).toolsets(item.config):
                tools += await stack.enter_async_context(
                    self._served(toolset, task=item, trace=trace))
            names = [t.name for t in tools]
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate tool names {sorted(names)}; keep MCP tool "
                                 "names qualified")
            rollout = await run_agent_loop(
                self.eval_backend if evaluation else self.backend, self.renderer,
                self.prompt_messages(item), tools=tools, parser=self.parser,
                max_turns=self.max_turns, max_token_length=self.config.max_token_length,
                max_tokens_per_turn=self.config.max_tokens_per_turn,
                policy_version=lambda: self.policy_version)
        rollout.extra["vf_trace"] = trace
        return rollout

    def _messages(self, rollout: Rollout) -> list[tuple[Any, bool]]:
        """The rollout's chat as verifiers messages, each with whether it was sampled."""
        vf = self.vf
        out = []
        for message in rollout.messages:
            role = message["role"]
            if role == "system":
                out.append((vf.SystemMessage(content=_message_text(message["content"])), False))
            elif role == "user":
                out.append((vf.UserMessage(content=_message_text(message["content"])), False))
            elif role == "assistant":
                calls = [vf.ToolCall(id=c["id"], name=c["function"]["name"],
                                     arguments=c["function"]["arguments"])
                         for c in message.get("tool_calls") or []]
                text = self.parser.parse(message["content"] or "").content if calls \
                    else (message["content"] or "").strip()
                out.append((vf.AssistantMessage(content=text, tool_calls=calls or None), True))
            elif role == "tool":
                out.append((vf.ToolMessage(tool_call_id=message.get("tool_call_id", ""),
                                           name=message.get("name"),
                                           content=_message_text(message["content"])), False))
        return out

    async def _score_prefix(self, item: Any, rollout: Rollout, messages: list[tuple[Any, bool]],
                            final: bool) -> Any:
        """``task.score`` on a trace of ``messages`` (a copy of the rollout's trace)."""
        from verifiers.v1.graph import MessageNode

        trace = rollout.extra["vf_trace"].model_copy(deep=True)
        trace.nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=sampled)
                       for i, (m, sampled) in enumerate(messages)]
        trace.ok = True
        trace.stop("max_turns" if final and rollout.stop == "max_turns" else
                   "max_total_tokens" if final and rollout.stop == "max_tokens" else
                   "agent_completed")
        await item.score(trace)
        missing = [name for name, r in trace.rewards.items() if r is None]
        if missing:
            raise RewardError(f"item {self.item_id(item)}: rewards {missing} were not scored")
        if not math.isfinite(trace.reward):
            raise RewardError(f"item {self.item_id(item)}: non-finite reward {trace.rewards}")
        return trace

    async def _outcome(self, item: Any, rollout: Rollout) -> Any:
        trace = await self._score_prefix(item, rollout, self._messages(rollout), final=True)
        rollout.extra["vf_rewards"] = {name: r.score for name, r in trace.rewards.items()}
        rollout.extra["vf_metrics"] = dict(trace.metrics)
        return trace

    async def compute_reward(self, item: Any, rollout: Rollout) -> float:
        return (await self._outcome(item, rollout)).reward

    async def compute_turn_rewards(self, item: Any, rollout: Rollout) -> list[float]:
        messages = self._messages(rollout)
        ends = [i for i, (_, sampled) in enumerate(messages) if sampled]
        scores = []
        for k in range(len(ends) - 1):  # turn k's message and its tool results
            scores.append((await self._score_prefix(item, rollout, messages[:ends[k + 1]],
                                                    final=False)).reward)
        scores.append((await self._outcome(item, rollout)).reward)
        return scores

    def rollout_metrics(self, item: Any, rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        return {**{f"reward/{k}": v for k, v in rollout.extra.get("vf_rewards", {}).items()},
                **{f"metric/{k}": v for k, v in rollout.extra.get("vf_metrics", {}).items()
                   if v is not None}}


def verifiers_env_class(taskset_id: str) -> type[VerifiersEnv]:
    """The env class of ``lachesis env ... verifiers:ID``: ``taskset_id`` is its default,
    its name (the groups' ``env``) ``verifiers-ID``. Checks that verifiers is installed
    and that ID names a taskset (verifiers' own errors say what is wrong). The
    ``verifiers`` env kind."""
    if not taskset_id:
        raise ValueError("verifiers:ID needs the taskset id (an importable module)")
    _require_verifiers()
    from verifiers.v1.utils.loaders import taskset_class

    taskset_class(taskset_id)
    config_class = create_model("VerifiersEnvConfig", __base__=VerifiersEnvConfig,
                                taskset_id=(str, Field(default=taskset_id, description=(
                                    VerifiersEnvConfig.model_fields["taskset_id"].description))))
    return type("VerifiersEnv", (VerifiersEnv,), {
        "name": f"verifiers-{taskset_id}", "config_class": config_class,
        "__module__": __name__})
