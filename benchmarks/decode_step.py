"""One decode step of the policy: vLLM's engine against transformers' ``generate``, side
by side in one process.

The quickstart's rollouts are short multi-turn episodes: a batch of 64 waits on a chain of
turns of up to 48 tokens each, so the time of one decode step at the batch's size sets
how fast a batch can be sampled, whatever else the framework does. This measures that
step for both engines on the same model (``--model``, e.g. the quickstart's warm start
``runs/quickstart/warm_start/final`` after ``make demo``), in this one process:

- **vLLM**: ``LLM.generate`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; eager and
  with dynamo off, as a Lachesis CPU server runs the model), ``--batch`` copies of a
  ``--prompt-tokens`` (75) token prompt, each sampling ``--new-tokens`` (48) tokens at
  temperature 1 with ``ignore_eos`` and its logprob (``logprobs=0``, as rollouts ask), no
  detokenizing;
- **transformers**: ``model.generate`` of the same prompts, ``min_new_tokens`` =
  ``max_new_tokens``, sampling at temperature 1 (what TRL's in-process generation runs).

Each is run once to warm up, then ``--rounds`` times; the best round's seconds over the
new tokens is its step time. Both run on the OpenMP threads vLLM's CPU worker binds in
this process (it ignores ``torch.set_num_threads`` after that), not set apart.
Printed: both, and vLLM's over transformers' per batch size.
Run it alone on the machine (under the heavy-work lock).

    .venv/bin/python benchmarks/decode_step.py --model runs/quickstart/warm_start/final
"""

from __future__ import annotations

import argparse
import json
import os
import time


def best_of(rounds: int, fn) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/quickstart/warm_start/final")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=75)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as a Lachesis CPU server: no compile

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = [5 + i % 300 for i in range(args.prompt_tokens)]
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=1 << 30)
    sampling = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=1.0,
                              logprobs=0, detokenize=False)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    generate = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
    rows = []
    for batch in args.batch:
        prompts = [TokensPrompt(prompt_token_ids=prompt)] * batch
        vllm_s = best_of(args.rounds, lambda: llm.generate(prompts, sampling, use_tqdm=False))
        ids = torch.tensor([prompt] * batch)
        with torch.no_grad():
            hf_s = best_of(args.rounds, lambda: model.generate(ids, **generate))
        row = {"batch": batch, "vllm_ms_per_step": 1000 * vllm_s / args.new_tokens,
               "transformers_ms_per_step": 1000 * hf_s / args.new_tokens,
               "vllm_over_transformers": vllm_s / hf_s}
        rows.append(row)
        print(f"batch {batch:4d}: vLLM {row['vllm_ms_per_step']:6.2f} ms a step, transformers "
              f"{row['transformers_ms_per_step']:6.2f} ms: vLLM / transformers = "
              f"{row['vllm_over_transformers']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "new_tokens": args.new_tokens,
                       "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
