"""The quickstart's RL through TRL's ``GRPOTrainer`` (in-process generation) against
``lachesis run``, side by side in one invocation.

Both start from the same policy (``--model``: the quickstart's warm start,
``runs/quickstart/warm_start/final`` after ``make demo``) and run ``--steps`` RL steps of
the quickstart's batch (8 groups of 8), learning rate and warm-up:

1. **Lachesis.** ``lachesis run`` of configs/quickstart.yaml's RL phase from that policy
   (the real processes: rollout API, vLLM CPU, env server, trainer), evaluated before
   and after on the env's 256 held-out items. Step times are the trainer's
   ``time/step``.
2. **TRL** (the ``bench`` extra). ``trl.GRPOTrainer`` in this process, the policy
   generating in-process (batched ``transformers`` ``generate``, TRL's default
   generation: its vLLM mode needs vLLM <= 0.31), given the ``arithmetic_tool`` env's own
   rollout code through TRL's documented ``rollout_func``: the env's agent loop, chat
   template, tool-call parser, calculator, items and turn rewards
   (``BaseEnv.collect_group``), every rollout's next turn in one ``generate`` call
   (:class:`InProcessBackend`). TRL gives one scalar reward per completion, so its two
   reward functions are the env's turn rewards summed: the calculator turn's (right
   expression) and the outcome's; the tool results are masked out of the loss
   (``env_mask``). ``lr_scheduler_type: constant_with_warmup`` is the trainer's linear
   warm-up to a constant learning rate (TRL's first step has learning rate 0, the
   trainer's lr/warm-up); TRL's other settings are its defaults (loss ``dapo``, no KL,
   gradient checkpointing on, torch's threads). It is evaluated before and after on the same 256 items with the
   same agent loop, in-process. Step times: from TRL's ``on_step_begin`` to
   ``on_step_end`` (generation, scoring, forward, backward, optimizer).

The first ``--skip`` steps of each are left out of the step times (warm-up). One
difference stays: Lachesis sets aside groups whose episodes all scored the same (no
signal) and trains on 8 groups with signal, drawing more when it must; TRL trains on
the 8 groups it drew, signal or not (``groups_with_signal`` says how many had it).

    .venv/bin/python benchmarks/trl_grpo.py \\
        --model runs/quickstart/warm_start/final --steps 30 --json /tmp/trl_grpo.json

``--config CONFIG`` runs another config's RL phase the same way (configs/quickstart.yaml
by default; ``--model`` defaults to its warm start, runs/NAME/warm_start/final): its env
settings, batch, learning rate and warm-up on both sides, and its trainer dtype on both
(``dtype: auto``: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16; TRL then gets the model
in bfloat16 and ``bf16`` on). ``--eval-every K`` gives accuracy curves: the starting
policy, TRL every K steps (inside its run, out of its timings) and Lachesis's checkpoints
(written every K steps; the run itself then evaluates nothing) are evaluated by one
evaluator, the env's ``evaluate()`` sampling in-process (:func:`evaluate_policy`), and the
script prints the wall time each side took to the same accuracy (from its start: for
Lachesis ``lachesis run``'s launch; evaluations left out):

    flock /tmp/lachesis-heavy.lock .venv/bin/python benchmarks/trl_grpo.py \\
        --config configs/smollm2.yaml --model runs/smollm2/warm_start/final \\
        --steps 12 --eval-every 4 --json /tmp/trl_smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
for path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from rl_step_time import (  # noqa: E402
    _steps, add_run_arguments, check_model, free_port, quickstart_config,
    resolve_run_arguments, run_config)


# -- in-process generation for the env's agent loop ------------------------------------
class InProcessBackend:
    """A :class:`~environments.rollout.TurnBackend` that samples with a ``transformers``
    model in this process. Turns wait until every rollout under way (counted by
    :meth:`track`) has asked for its next one, or finished; then one left-padded,
    batched ``generate`` samples them all (each cut after its first stop token or at its
    own ``max_tokens``), with the sampling distribution's logprob of every token."""

    trainable = True

    def __init__(self, model: Any, renderer: Any, sampling: dict[str, Any]):
        """``sampling``: the env's (``EnvConfig.sampling``): temperature (0: greedy) and
        top_p; nothing else is supported."""
        other = sorted(set(sampling) - {"temperature", "top_p"})
        if other:
            raise ValueError(f"in-process generation supports temperature and top_p, "
                             f"not {other} (sampling_extra)")
        self.model = model
        self.renderer = renderer
        self.temperature = float(sampling.get("temperature", 1.0))
        self.top_p = float(sampling.get("top_p", 1.0))
        self.stop_token_ids = set(renderer.stop_token_ids)
        self.pad_id = renderer.tokenizer.pad_token_id
        self.pending: list[tuple[list[int], int, asyncio.Future]] = []
        """(context, max_tokens, future of the turn) of each turn asked for."""
        self.active = 0
        self.batches: list[int] = []
        """The size of each ``generate`` call."""
        self._check_scheduled = False

    def track(self, collect_trajectory: Any) -> Any:
        """``collect_trajectory`` counted as a rollout under way while it runs."""
        async def tracked(*args: Any, **kwargs: Any) -> Any:
            self.active += 1
            try:
                return await collect_trajectory(*args, **kwargs)
            finally:
                self.active -= 1
                self._schedule_check()
        return tracked

    async def generate(self, state: Any, max_tokens: int) -> Any:
        return await self.generate_from(state.context, max_tokens)

    async def generate_from(self, token_ids: list[int], max_tokens: int) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((list(token_ids), max_tokens, future))
        self._schedule_check()
        return await future

    def _schedule_check(self) -> None:
        # checked once the tasks ready now have run (each runs to its next request)
        if not self._check_scheduled:
            self._check_scheduled = True
            asyncio.get_running_loop().call_soon(self._check)

    def _check(self) -> None:
        self._check_scheduled = False
        if self.pending and len(self.pending) >= self.active:
            batch, self.pending = self.pending, []
            try:
                turns = self.sample([c for c, _, _ in batch], [n for _, n, _ in batch])
            except Exception as error:  # noqa: BLE001 - each rollout fails with it
                for _, _, future in batch:
                    future.set_exception(error)
                return
            for (_, _, future), turn in zip(batch, turns):
                future.set_result(turn)

    def sample(self, contexts: list[list[int]], max_tokens: list[int]) -> list[Any]:
        import torch

        from environments.inference.backends import sampled_turn

        self.batches.append(len(contexts))
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            mask[i, width - len(c):] = 1
        with torch.no_grad():
            sample = {"do_sample": True, "temperature": self.temperature, "top_k": 0,
                      "top_p": self.top_p} if self.temperature > 0 else {"do_sample": False}
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, **sample,
                max_new_tokens=max(max_tokens), eos_token_id=sorted(self.stop_token_ids),
                pad_token_id=self.pad_id, return_dict_in_generate=True, output_logits=True)
            new = out.sequences[:, width:]
            logits = torch.stack(out.logits, dim=1).float() / (self.temperature or 1.0)
            logprobs = torch.log_softmax(logits, dim=-1).gather(
                -1, new.unsqueeze(-1)).squeeze(-1)
        turns = []
        for row, lps, limit in zip(new.tolist(), logprobs.tolist(), max_tokens):
            end = next((k + 1 for k, t in enumerate(row) if t in self.stop_token_ids),
                       len(row))
            reason = "stop" if end <= limit and row[end - 1] in self.stop_token_ids \
                else "length"
            end = min(end, limit)
            turns.append(sampled_turn(self.renderer, self.stop_token_ids, row[:end],
                                      lps[:end], reason))
        return turns


def make_env(model: Any, tokenizer: Any, settings: dict[str, Any], concurrency: int) -> Any:
    """The ``arithmetic_tool`` env (``settings``: the quickstart's) rolling out with
    ``model`` in-process; every group is kept (TRL needs its 8 completions)."""
    from environments.envs.arithmetic_tool import ArithmeticToolEnv
    from environments.inference.chat_template import ChatRenderer

    env = ArithmeticToolEnv(ArithmeticToolEnv.config_class.model_validate({
        **settings, "keep_equal_score_groups": True, "concurrency": concurrency,
        "max_queued_groups": None}))
    env.renderer = ChatRenderer(tokenizer)
    env.backend = InProcessBackend(model, env.renderer, env.config.sampling())
    env.eval_backend = InProcessBackend(model, env.renderer,
                                        env.config.sampling(evaluation=True))
    collect = env.collect_trajectory
    env.collect_trajectory = env.backend.track(env.eval_backend.track(collect))
    return env


def trajectory_row(trajectory: Any) -> dict[str, Any]:
    """One TRL completion of a scored trajectory: the prompt, the rest (assistant turns,
    tool results, template tokens), which of it the policy sampled (``env_mask``), the
    sampling logprobs, and the env's turn rewards."""
    from environments.trajectory import MASKED

    start = trajectory.turn_spans[0][0]
    sampled = [int(m != MASKED) for m in trajectory.masks[start:]]  # (Atropos masks)
    scores = trajectory.scores if isinstance(trajectory.scores, list) else [trajectory.scores]
    return {"prompt_ids": trajectory.tokens[:start],
            "completion_ids": trajectory.tokens[start:],
            "env_mask": sampled,
            "logprobs": [float(x) if s else 0.0 for x, s in
                         zip(trajectory.inference_logprobs[start:], sampled)],
            "turn_rewards": [float(s) for s in scores]}


def env_rollouts(env: Any, items: dict[str, Any], loop: asyncio.AbstractEventLoop,
                 prompts: list[Any]) -> dict[str, list[Any]]:
    """TRL's ``rollout_func`` output for ``prompts`` (each prompt ``group_size`` times in
    a row, as TRL's sampler repeats it): one env group per run of equal prompts."""
    size = env.config.group_size
    if len(prompts) % size:
        raise ValueError(f"{len(prompts)} prompts: not runs of group_size {size}")
    questions = [p[-1]["content"] for p in prompts]
    runs = [questions[i:i + size] for i in range(0, len(questions), size)]
    if any(len(set(run)) != 1 for run in runs):
        raise ValueError("TRL did not repeat each prompt group_size times in a row")

    async def collect() -> list[Any]:
        return await asyncio.gather(*(env.collect_group(items[run[0]]) for run in runs))

    groups = loop.run_until_complete(collect())
    rows = [trajectory_row(t) for g in groups for t in g.trajectories]
    return {key: [row[key] for row in rows] for key in rows[0]}


def tool_call_reward(completions: Any, turn_rewards: list[list[float]],
                     **_: Any) -> list[float]:
    """The turns before the answer (the calculator call): their mean turn reward."""
    return [sum(r[:-1]) / len(r[:-1]) if len(r) > 1 else 0.0 for r in turn_rewards]


def outcome_reward(completions: Any, turn_rewards: list[list[float]], **_: Any) -> list[float]:
    """The answer turn's reward (the outcome)."""
    return [r[-1] for r in turn_rewards]


def grpo_trainer(env: Any, items: list[Any], loop: asyncio.AbstractEventLoop, model: Any,
                 tokenizer: Any, *, steps: int, batch: int, lr: float, warmup_steps: int,
                 output_dir: Path, seed: int, callbacks: list[Any] = (), bf16: bool = False
                 ) -> tuple[Any, list[int]]:
    """TRL's ``GRPOTrainer`` on ``items`` of ``env`` (rolled out by ``env``'s own code,
    :func:`env_rollouts`), ``batch`` completions a step in groups of the env's
    ``group_size``; and the list to which each step appends its groups with signal.
    ``bf16``: TRL's bf16 setting (give it a model loaded in bfloat16, as the trainer
    loads it with ``dtype: bfloat16``: both then train the bfloat16 weights)."""
    import datasets
    import trl
    from trl.models import unwrap_model_for_generation

    by_question = {item["question"]: item for item in items}
    dataset = datasets.Dataset.from_list(
        [{"prompt": env.prompt_messages(item)} for item in by_question.values()])
    group = env.config.group_size
    signal: list[int] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        # as TRL's own generation does: the bare model, without gradient checkpointing
        # (transformers' generate without its KV cache samples garbage here)
        with unwrap_model_for_generation(
                trainer.model_wrapped, trainer.accelerator,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
        ) as model_now:
            env.backend.model = model_now
            out = env_rollouts(env, by_question, loop, prompts)
        totals = [sum(r) for r in out["turn_rewards"]]
        signal.append(sum(len(set(totals[i:i + group])) > 1
                          for i in range(0, len(totals), group)))
        return out

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = trl.GRPOTrainer(
        model=model, processing_class=tokenizer,
        reward_funcs=[tool_call_reward, outcome_reward], train_dataset=dataset,
        rollout_func=rollout_func, callbacks=list(callbacks),
        args=trl.GRPOConfig(
            output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch,
            num_generations=group, gradient_accumulation_steps=1, learning_rate=lr,
            warmup_steps=warmup_steps, lr_scheduler_type="constant_with_warmup",
            temperature=env.config.temperature,
            max_completion_length=env.config.max_token_length, use_cpu=True, bf16=bf16,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            seed=seed))
    return trainer, signal


def policy_dtype(config: dict[str, Any]) -> str:
    """The trainer's dtype in ``config`` (``train.dtype``; ``auto``: bfloat16 on a CPU with
    AMX-BF16 or AVX512-BF16, environments/inference/dtypes.py), as ``lachesis run``
    resolves it."""
    from environments.inference.dtypes import resolve_dtype

    return resolve_dtype(config.get("train", {}).get("dtype", "float32"))


def eval_settings(config: dict[str, Any], model: str) -> dict[str, Any]:
    return {**config["envs"][0]["settings"], "tokenizer": model}


def evaluate_policy(model_dir: str | Path, config: dict[str, Any], tokenizer_dir: str
                    ) -> dict[str, Any]:
    """The env's held-out evaluation (its ``eval_items`` at its eval temperature) of the
    policy in ``model_dir``, sampled in-process (:class:`InProcessBackend`, the config's
    trainer dtype): the evaluator of both sides' curves (``--eval-every``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if policy_dtype(config) == "bfloat16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    settings = eval_settings(config, tokenizer_dir)
    env = make_env(model, tokenizer, settings, concurrency=settings.get("eval_items", 256))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(env.setup())
        started = time.monotonic()
        result = loop.run_until_complete(env.evaluate())
        loop.run_until_complete(env.close())
    finally:
        loop.close()
    return {**result, "seconds": time.monotonic() - started}


def curve_point(step: int, train_s: float, wall_s: float, result: dict[str, Any]
                ) -> dict[str, Any]:
    return {"step": step, "train_s": round(train_s, 2), "wall_s": round(wall_s, 2),
            "accuracy": result["correct"], "accuracy_ci95": result["correct_ci95"],
            "eval_s": round(result["seconds"], 1)}


def trl_side(args: argparse.Namespace, config: dict[str, Any],
             start: dict[str, Any] | None = None) -> dict[str, Any]:
    """``start``: the starting policy's evaluation, already done (``--eval-every``)."""
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.models import unwrap_model_for_generation

    side_started = time.monotonic()
    eval_seconds = 0.0  # evaluations left out of the wall time
    settings = eval_settings(config, args.model)
    train = config["train"]
    batch, group = train["batch_size"], settings["group_size"]
    dtype = policy_dtype(config)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    env = make_env(model, tokenizer, settings, concurrency=max(batch, settings["eval_items"]))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(env.setup())

    def evaluate() -> dict[str, Any]:
        nonlocal eval_seconds
        model.eval()
        if model.is_gradient_checkpointing:  # (TRL turns it on for training)
            model.gradient_checkpointing_disable()
        started = time.monotonic()
        result = loop.run_until_complete(env.evaluate())
        eval_seconds += time.monotonic() - started
        return {**result, "seconds": time.monotonic() - started}

    before = start if start is not None else evaluate()
    print(f"TRL side ({dtype}): evaluation before: accuracy {before['correct']:.3f} "
          f"({before['seconds']:.1f} s)", flush=True)
    items = [loop.run_until_complete(env.get_next_item())
             for _ in range(args.steps * batch // group)]
    curve = [curve_point(0, 0.0, 0.0, before)]
    trainer: list[Any] = []  # the GRPOTrainer, once made

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.logs: list[dict[str, Any]] = []

        def on_step_begin(self, args_, state, control, **kwargs):
            self.began = time.monotonic()

        def on_step_end(self, args_, state, control, **kwargs):
            self.seconds.append(time.monotonic() - self.began)
            step = state.global_step
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                # the held-out evaluation mid-run, left out of the step times and the
                # wall time: the model unwrapped for generation as rollout_func does
                nonlocal eval_seconds
                wall = time.monotonic() - side_started - eval_seconds
                started = time.monotonic()
                grpo = trainer[0]
                with unwrap_model_for_generation(
                        grpo.model_wrapped, grpo.accelerator,
                        gradient_checkpointing_kwargs=grpo.args.gradient_checkpointing_kwargs
                ) as model_now:
                    was_training = model_now.training
                    model_now.eval()
                    env.eval_backend.model = model_now
                    result = loop.run_until_complete(env.evaluate())
                    env.eval_backend.model = model
                    model_now.train(was_training)
                seconds = time.monotonic() - started
                eval_seconds += seconds
                curve.append(curve_point(step, sum(self.seconds), wall,
                                         {**result, "seconds": seconds}))
                print(f"TRL side: step {step}: accuracy {result['correct']:.3f} "
                      f"({seconds:.1f} s)", flush=True)

        def on_log(self, args_, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    times = StepTimes()
    grpo, signal = grpo_trainer(
        env, items, loop, model, tokenizer, steps=args.steps, batch=batch,
        lr=train["lr"], warmup_steps=train["warmup_steps"],
        output_dir=Path(args.workdir) / "trl", seed=args.seed, callbacks=[times],
        bf16=dtype == "bfloat16")
    trainer.append(grpo)
    model.train()
    started, evals_before = time.monotonic(), eval_seconds
    grpo.train()
    wall = time.monotonic() - started - (eval_seconds - evals_before)  # mid-run evals out
    side_wall = time.monotonic() - side_started - eval_seconds
    after = evaluate()
    curve.append(curve_point(len(times.seconds), sum(times.seconds), side_wall, after))
    steps = times.seconds[args.skip:]
    rewards = [log["reward"] for log in times.logs if "reward" in log]
    loop.run_until_complete(env.close())
    loop.close()
    return {
        "side": "trl", "trl_version": trl.__version__, "dtype": dtype,
        "steps": len(times.seconds),
        "timed_steps": len(steps), "median_step_s": statistics.median(steps),
        "mean_step_s": statistics.mean(steps), "max_step_s": max(steps),
        "completions_per_s": batch * len(steps) / sum(steps), "train_wall_s": wall,
        "reward_mean_first_5": statistics.mean(rewards[:5]) if rewards else None,
        "reward_mean_last_5": statistics.mean(rewards[-5:]) if rewards else None,
        "groups_with_signal_mean": statistics.mean(signal) if signal else None,
        "generate_batches_mean": statistics.mean(env.backend.batches),
        "accuracy_before": before["correct"], "accuracy_after": after["correct"],
        "accuracy_after_ci95": after["correct_ci95"], "eval_items": after["items"],
        "eval_failed": after["failed"], "curve": curve,
        "wall_to_end_s": side_wall, "step_s": times.seconds}


def lachesis_side(args: argparse.Namespace, config_dict: dict[str, Any],
                  start: dict[str, Any] | None = None) -> dict[str, Any]:
    """``lachesis run`` of the config's RL phase from ``--model``. With ``--eval-every K``
    (``start``: the starting policy's evaluation): no evaluation inside the run; a
    checkpoint every K steps, each evaluated afterwards by :func:`evaluate_policy`, the
    evaluator of TRL's side, and the wall time of each step read as its metrics line
    appears (from the run's launch: vLLM's start, the trainer's load included)."""
    name = "bench-trl-lachesis"
    config = run_config(args.model, name, args.steps, {}, free_port(), args.config)
    curves = bool(args.eval_every)
    config["evaluate"] = not curves
    if curves:
        config["train"].update(checkpoint_every=args.eval_every,
                               keep_checkpoints=args.steps // args.eval_every + 1)
    config_path = Path(args.workdir) / f"{name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = Path(args.workdir) / f"{name}.log"
    run_dir = Path("runs") / name
    metrics_path = run_dir / "trainer" / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)  # (--fresh removes it too; not seen before then)
    appeared: dict[int, float] = {}  # step -> seconds from the launch to its metrics line
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lachesis.cli", "run", str(config_path), "--fresh"],
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=log,
            stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - started > args.timeout:
                    raise TimeoutError(f"lachesis run ran past {args.timeout} s "
                                       f"(log: {log_path})")
                now = time.monotonic() - started
                for line in _steps(metrics_path):
                    appeared.setdefault(line["step"], now)
                time.sleep(0.25)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"lachesis run exited with {proc.returncode} (log: {log_path})")
    steps = _steps(metrics_path)
    timed = [s for s in steps if s["step"] > args.skip]
    step_s = [s["time/step"] for s in timed]
    rewards = [s["reward_mean"] for s in steps]
    if curves:
        from trainer.checkpoint import checkpoint_dir

        before = start
        curve = [curve_point(0, 0.0, 0.0, start)]
        for k in range(args.eval_every, args.steps + 1, args.eval_every):
            if k not in {s["step"] for s in steps}:
                break
            checkpoint = checkpoint_dir(run_dir / "trainer", k)
            result = evaluate_policy(checkpoint, config_dict, args.model)
            curve.append(curve_point(
                k, sum(s["time/step"] for s in steps if s["step"] <= k),
                appeared.get(k, wall), result))
            print(f"Lachesis side: step {k}: accuracy {result['correct']:.3f} "
                  f"({result['seconds']:.1f} s)", flush=True)
        if curve[-1]["step"] != len(steps):
            result = evaluate_policy(checkpoint_dir(run_dir / "trainer", len(steps)),
                                     config_dict, args.model)
            curve.append(curve_point(len(steps), sum(s["time/step"] for s in steps),
                                     appeared.get(len(steps), wall), result))
        after = result
    else:
        curve = None
        before, after = (
            json.loads((run_dir / "eval" / f"{when}-arithmetic_tool.json").read_text())
            for when in ("before", "after"))
    return {
        "side": "lachesis", "dtype": policy_dtype(config_dict), "steps": len(steps),
        "timed_steps": len(timed),
        "median_step_s": statistics.median(step_s), "mean_step_s": statistics.mean(step_s),
        "max_step_s": max(step_s),
        "completions_per_s": sum(s["rows"] for s in timed) / sum(step_s),
        "run_wall_s": wall,
        "checkpoint_s": sum(s.get("time/checkpoint", 0.0) for s in steps),
        "reward_mean_first_5": statistics.mean(rewards[:5]),
        "reward_mean_last_5": statistics.mean(rewards[-5:]),
        "groups_set_aside": sum(s.get("groups_set_aside", 0) for s in steps),
        "accuracy_before": before["correct"], "accuracy_after": after["correct"],
        "accuracy_after_ci95": after["correct_ci95"], "eval_items": after["items"],
        "eval_failed": after["failed"], "curve": curve,
        "wall_to_end_s": appeared.get(len(steps)), "step_s": [s["time/step"] for s in steps],
        "log": str(log_path)}


def time_to_accuracy(results: list[dict[str, Any]], target: float | None
                     ) -> tuple[float, dict[str, dict[str, Any] | None]]:
    """The target accuracy (``target``, else the lower of the sides' best accuracies after
    step 0: one both reached) and, per side, the first point after step 0 at or above it."""
    if target is None:
        target = min(max((p["accuracy"] for p in r["curve"] if p["step"] > 0), default=0.0)
                     for r in results)
    return target, {r["side"]: next((p for p in r["curve"]
                                     if p["step"] > 0 and p["accuracy"] >= target), None)
                    for r in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, steps=30)
    parser.add_argument("--seed", type=int, default=0, help="TRL's seed")
    parser.add_argument("--sides", default="lachesis,trl",
                        help="which to run, in this order (comma-separated)")
    parser.add_argument("--eval-every", type=int, default=None, metavar="K",
                        help="accuracy curves: both sides evaluated every K steps and at the "
                        "end by the same in-process evaluator (the starting policy once), "
                        "and the wall time each took to the same accuracy")
    parser.add_argument("--target", type=float, default=None,
                        help="with --eval-every: the accuracy to time (default: the lower "
                        "of the two sides' best)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workdir", default="runs/bench-trl")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    resolve_run_arguments(args)
    check_model(args.model)
    sides = args.sides.split(",")
    if unknown := [s for s in sides if s not in ("lachesis", "trl")]:
        sys.exit(f"--sides: unknown {unknown}; use lachesis and/or trl")
    if args.steps <= args.skip:
        sys.exit(f"--steps {args.steps} must be more than --skip {args.skip}")
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("TRL is not installed: pip install -e '.[bench]'")
    config = quickstart_config(args.config)
    train, settings = config["train"], config["envs"][0]["settings"]
    batch, group = train["batch_size"], settings["group_size"]
    start = None
    if args.eval_every:
        start = evaluate_policy(args.model, config, args.model)
        print(f"the starting policy ({policy_dtype(config)}, in-process): accuracy "
              f"{start['correct']:.3f} ({start['seconds']:.1f} s)", flush=True)
    results = []
    for side in sides:
        print(f"-- {side}: {args.steps} steps from {args.model}", flush=True)
        result = lachesis_side(args, config, start) if side == "lachesis" \
            else trl_side(args, config, start)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "step_s"}), flush=True)
    print(f"\n{args.steps} steps of {batch // group} groups of {group} from {args.model} "
          f"({args.config or 'configs/quickstart.yaml'}, {policy_dtype(config)}; the first "
          f"{args.skip} left out of the step times)\n")
    print("| | median s/step | mean s/step | completions/s | accuracy before | "
          "accuracy after [95 % CI] |")
    print("|---|---:|---:|---:|---:|---:|")
    label = {"lachesis": "`lachesis run` (vLLM CPU)",
             "trl": "TRL `GRPOTrainer`, in-process generation"}
    for r in results:
        low, high = r["accuracy_after_ci95"]
        print(f"| {label[r['side']]} | {r['median_step_s']:.2f} | {r['mean_step_s']:.2f} | "
              f"{r['completions_per_s']:.1f} | {r['accuracy_before']:.3f} | "
              f"{r['accuracy_after']:.3f} [{low:.3f}, {high:.3f}] |")
    by_side = {r["side"]: r for r in results}
    if len(by_side) == 2:
        ratio = by_side["lachesis"]["median_step_s"] / by_side["trl"]["median_step_s"]
        print(f"\nmedian step, lachesis / TRL = {ratio:.2f} (goal <= 1: "
              f"{'met' if ratio <= 1 else 'NOT met'})")
    if args.eval_every:
        print("\naccuracy curves (the same in-process evaluator; wall s: from the side's "
              "start, evaluations left out; train s: the summed step times)\n")
        print("| side | step | train s | wall s | accuracy [95 % CI] |")
        print("|---|---:|---:|---:|---:|")
        for r in results:
            for p in r["curve"]:
                low, high = p["accuracy_ci95"]
                print(f"| {r['side']} | {p['step']} | {p['train_s']:.0f} | {p['wall_s']:.0f} | "
                      f"{p['accuracy']:.3f} [{low:.3f}, {high:.3f}] |")
        target, reached = time_to_accuracy(results, args.target)
        print(f"\ntime to accuracy >= {target:.3f}:")
        for side, p in reached.items():
            print(f"  {side}: " + ("not reached" if p is None else
                                   f"step {p['step']}, {p['wall_s']:.0f} s wall, "
                                   f"{p['train_s']:.0f} s of steps"))
        start_accuracy = results[0]["curve"][0]["accuracy"]
        if target <= start_accuracy:
            print(f"(the starting policy had {start_accuracy:.3f} already: no gain to time)")
        if len(reached) == 2 and all(reached.values()) and reached["trl"]["wall_s"] > 0:
            ratio = reached["lachesis"]["wall_s"] / reached["trl"]["wall_s"]
            print(f"wall time to it, lachesis / TRL = {ratio:.2f} (goal <= 1: "
                  f"{'met' if ratio <= 1 else 'NOT met'})")
        for r in results:
            r["target_accuracy"] = target
            r["reached"] = reached.get(r["side"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
