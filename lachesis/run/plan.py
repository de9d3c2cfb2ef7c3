"""``lachesis run CONFIG --plan``: every process the run would start (command line,
devices, port, URL, log), the batch arithmetic, and what cannot work, without starting
anything.

What is checked (each problem is one line saying what to change):

* every section against its process's settings (:meth:`RunConfig.check_sections`: an env
  that cannot be found, a wrong key, a device given to two processes, ...);
* devices asked for that this machine does not have;
* each env's group size divides the trainer's batch;
* the model's vocabulary holds every id of the tokenizer, and the tokenizer has a chat
  template the rollouts can use;
* each env's ``max_token_length`` and ``max_tokens_per_turn`` fit the vLLM servers'
  ``vllm.max_model_len`` (:mod:`environments.framework.limits`; each env checks the same
  against its servers' reported ``max_model_len`` again when it starts).

More checks plug in through :data:`PLAN_CHECKS`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.inference.backends import CONSTRAINED as CONSTRAINED_SAMPLING
from lachesis.run.config import RunConfig, batch_problems, env_facts
from lachesis.run.layout import Layout, build_layout, policy_model


@dataclass
class Plan:
    config: RunConfig
    layout: Layout | None
    """None when the train section is too wrong to lay the run out."""
    model: str
    """The model RL starts from (the warm start's result when there is one)."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What will run but likely not as meant (printed, does not stop the run)."""


def constrained_sampling_warnings(config: RunConfig) -> list[str]:
    """Envs that sample with constrained decoding: vLLM's logprobs are then those of the
    constrained distribution, not the policy's, so the trainer's step-0 alignment check
    fails and the importance ratios are off."""
    warnings = []
    for i, env in enumerate(config.envs):
        extra = env.settings.get("sampling_extra") or {}
        keys = [k for k in CONSTRAINED_SAMPLING if k in extra]
        if keys:
            warnings.append(
                f"envs[{i}] ({env.name}): sampling_extra.{keys[0]} constrains sampling; "
                "vLLM's logprobs are then of the constrained distribution, not the policy's, "
                "so the trainer's step-0 alignment check will fail (tokens, masks or the "
                "model do not line up) and its importance ratios are off: sample without it")
    return warnings


PlanCheck = Callable[[Plan], list[str]]


def context_limit_problems(plan: Plan) -> list[str]:
    """Every env whose ``max_token_length`` or ``max_tokens_per_turn`` does not fit
    ``vllm.max_model_len``: vLLM would refuse its long contexts mid-episode and drop their
    groups (:mod:`environments.framework.limits`)."""
    from environments.framework.limits import context_limit_problems as problems_of

    config = plan.config
    max_model_len = config.vllm.max_model_len
    problems = []
    if any(arg.split("=")[0] == "--max-model-len" for arg in config.vllm.args):
        problems.append("vllm.args: set vllm.max_model_len instead of --max-model-len (the "
                        "envs' token limits are checked against vllm.max_model_len)")
    for i, env in enumerate(config.envs):
        try:
            facts = env_facts(env)
        except (ValueError, LookupError, OSError):
            continue  # reported by the section checks
        where = f"envs[{i}].settings" + (".env" if facts["kind"] == "atropos" else "")
        problems += [f"env {env.name}: {p}" for p in problems_of(
            facts["max_token_length"], facts.get("max_tokens_per_turn"), max_model_len,
            f"vllm.max_model_len {max_model_len}",
            env_setting=lambda name, where=where: f"{where}.{name}",
            server_fix=lambda n: f"vllm.max_model_len to {n} or more")]
    return problems


def token_problems(plan: Plan) -> list[str]:
    """A token in the run config: it would be written into the settings files under
    ``runs/NAME/configs/`` and differ from the run's, which every process gets in its
    environment (docs/security.md)."""
    config = plan.config
    found = [f"{where}.{key}" for where, settings, key in (
        ("api", config.api, "token"), ("train", config.train, "api_token"),
        *((f"envs[{i}].settings", env.settings, "api_token")
          for i, env in enumerate(config.envs))) if key in (settings or {})]
    return [f"{where}: the run's token is not set in the config; set LACHESIS_API_TOKEN in "
            "the environment of `lachesis run` (or leave it out: each run makes its own)"
            for where in found]


PLAN_CHECKS: list[PlanCheck] = [context_limit_problems, token_problems]
"""More checks of a plan, each returning its problems (one line each); ``--plan`` prints
them and ``lachesis run`` refuses to start on them."""


def device_count() -> int:
    """GPUs this process sees (0 without CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_problems(layout: Layout, present: int) -> list[str]:
    problems = []
    for process in layout.processes:
        missing = [d for d in process.devices or [] if d >= present]
        if missing:
            problems.append(
                f"{process.name}: device(s) {missing} asked for, but this machine has "
                f"{present} GPU(s){' (CUDA_VISIBLE_DEVICES counts)' if present else ''}")
    return problems


def tokenizer_problems(model: str, planned_model: str) -> list[str]:
    """The model's vocabulary against its tokenizer, and the chat template."""
    if not Path(model).exists():
        return []  # built or downloaded at start; nothing to read yet
    try:
        from transformers import AutoConfig

        from environments.inference.tokenizer import load_tokenizer
    except ImportError:
        return []
    try:
        tokenizer = load_tokenizer(model)
        model_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        return [f"model {model}: cannot read its tokenizer or config ({error})"]
    problems = []
    vocab = getattr(model_config, "vocab_size", None) \
        or getattr(model_config.get_text_config(), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        problems.append(
            f"model {model}: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocabulary {vocab}: ids from {vocab} on would index past its embedding; use "
            "the tokenizer the model was trained with")
    from environments.inference.chat_template import ChatRenderer, ChatTemplateError

    try:
        ChatRenderer(tokenizer)
    except ChatTemplateError as error:
        problems.append(f"model {model}: {error}: rollouts render chats with it")
    if model != planned_model:
        problems = [f"{p} (the warm start trains from it)" for p in problems]
    return problems


def make_plan(config: RunConfig, *, devices_present: int | None = None,
              check_devices: bool = True) -> Plan:
    """The layout of ``config`` and every problem found, starting nothing
    (``check_devices``: also the devices it asks for against this machine's)."""
    model = policy_model(config)
    problems = []
    try:
        config.check_sections()
    except (ValueError, LookupError, OSError) as error:
        problems.append(str(error))
    try:
        layout = build_layout(config, model)
    except (ValueError, LookupError):  # the train section itself is wrong (reported)
        layout = None
    plan = Plan(config, layout, model, problems)
    if layout is not None and check_devices:
        plan.problems += device_problems(layout, device_count() if devices_present is None
                                         else devices_present)
    try:  # every env whose group size does not fit, not only the first
        plan.problems += [p for p in batch_problems(config) if p not in plan.problems]
    except (ValueError, LookupError, OSError):
        pass  # an env or the train section is wrong: reported above
    plan.problems += tokenizer_problems(config.model, model)
    for check in PLAN_CHECKS:
        plan.problems += check(plan)
    plan.warnings += constrained_sampling_warnings(config)
    if config.build_tiny_model and not Path(config.model).exists():
        plan.notes.append(f"the tiny model is built in {config.model} at start")
    if config.warm_start is not None and not Path(model).exists():
        plan.notes.append(f"the warm start (SFT on {config.warm_start.env} demonstrations) "
                          f"writes {model} first")
    return plan


def batch_lines(config: RunConfig) -> list[str]:
    from trainer.config import TrainConfig

    train = TrainConfig.model_validate({"model": config.model, **config.rl_train})
    lines = [f"batch: {train.batch_size} sequences per step, {train.steps} steps, "
             f"weights synced every {train.sync_every} step(s)"]
    total_weight = sum(env.weight for env in config.envs)
    longest = 0
    for env in config.envs:
        try:
            facts = env_facts(env)
        except (ValueError, LookupError, OSError):
            lines.append(f"  {env.name}: cannot be loaded (see problems)")
            continue
        longest = max(longest, facts["max_token_length"])
        share = env.weight / total_weight
        groups = train.batch_size / facts["group_size"]
        kind = " (atroposlib env)" if facts["kind"] == "atropos" else ""
        lines.append(
            f"  {env.name}{kind}: group size {facts['group_size']}, {share:.0%} of the mix "
            f"(weight {env.weight:g}, {env.count} server(s)); a batch of it alone holds "
            f"{groups:g} groups; at most {facts['max_token_length']} tokens per sequence")
    if longest:
        lines.append(f"  tokens per step: at most {train.batch_size} x {longest} = "
                     f"{train.batch_size * longest:,}")
    return lines


def listening_lines(layout: Layout) -> list[str]:
    """What listens where, and what guards it (docs/security.md)."""
    lines = ["listening (the run's token: LACHESIS_API_TOKEN if set, else a new one per run; "
             "given to every process in its environment):"]
    for p in layout.processes:
        if p.url is None:
            continue
        host = p.url.split("//", 1)[1].rsplit(":", 1)[0]
        reach = "loopback only" if host == "127.0.0.1" else f"reachable at {host}"
        guard = "guarded: the run's token on every route but its health check" if p.guarded \
            else "not guarded (no authentication of its own)"
        lines.append(f"  {p.name}: {p.url} ({reach}); {guard}"
                     + (f", runs beside {p.slot}" if p.slot and not p.guarded else ""))
    ranks = layout.trainers
    if len(ranks) > 1:
        master = ranks[0].env.get("MASTER_ADDR")
        lines.append(f"  trainer ranks: rendezvous (torch's TCP store) at {master}:"
                     f"{ranks[0].env.get('MASTER_PORT')} (that address only); not guarded")
    elif "torch.distributed.run" in ranks[0].command:
        lines.append("  trainer: its ranks' rendezvous (torchrun --standalone) on loopback")
    lines.append("  env servers listen on nothing (a black-box env's proxy: loopback, a token "
                 "per rollout); the trainer's in-memory weight transfer over gloo listens on "
                 "its address towards the vLLM servers for each handshake, not guarded")
    return lines


def format_plan(plan: Plan) -> str:
    config = plan.config
    lines = [f"plan of run {config.name!r} (nothing started); everything under "
             f"{config.run_dir}/", f"model: {plan.model}"]
    lines += [f"note: {n}" for n in plan.notes]
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append("")
    lines.append("processes:" if plan.layout is not None else
                 "processes: cannot be laid out (see problems)")
    for p in plan.layout.processes if plan.layout is not None else []:
        where = ", ".join(x for x in (
            f"devices {','.join(map(str, p.devices))}" if p.devices is not None else
            "devices not placed", f"port {p.port}" if p.port else "", p.url or "") if x)
        lines.append(f"  {p.name}: {where}")
        lines.append(f"    log: {p.log_path}")
        if p.env:
            lines.append(f"    env: {' '.join(f'{k}={v}' for k, v in sorted(p.env.items()))}")
        lines.append(f"    $ {shlex.join(p.command)}")
    if plan.layout is not None:
        lines.append("")
        lines += listening_lines(plan.layout)
    lines.append("")
    try:
        lines += batch_lines(config)
    except (ValueError, LookupError, OSError):
        lines.append("batch: cannot be worked out (see problems)")
    lines.append("")
    if plan.problems:
        lines.append(f"problems ({len(plan.problems)}): the run would not start")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("problems: none found")
    return "\n".join(lines)


def print_plan(config: RunConfig, **kwargs: Any) -> int:
    """Print the plan; 0 when no problem was found, else 1."""
    plan = make_plan(config, **kwargs)
    print(format_plan(plan), flush=True)
    return 1 if plan.problems else 0
