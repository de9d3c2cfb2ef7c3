"""The GPU example configs (configs/examples/), checked against locally built configs of
their models' shapes (lachesis.model_shapes; no weights, nothing downloaded): each is a
valid ``lachesis run`` config, its lengths fit the model's context, and what it trains
exists in the model."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from lachesis.model_shapes import build_config
from lachesis.run.config import RunConfig
from trainer.config import TrainConfig
from trainer.vllm_sync import sync_method

EXAMPLES = {"qwen2.5-1.5b-full.yaml": ("Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-1.5b"),
            "qwen3-4b-lora.yaml": ("Qwen/Qwen3-4B", "qwen3-4b")}


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_config_fits_its_model(example, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.lora import apply_lora

    hub_name, shape = EXAMPLES[example]
    path = REPO / "configs" / "examples" / example
    assert RunConfig.load(path).model == hub_name
    local = tmp_path / shape  # the model's config.json, built here
    build_config(shape).save_pretrained(local)
    run = RunConfig.load(path, model=str(local))  # every section validates
    model_config = AutoConfig.from_pretrained(local)
    assert model_config.tie_word_embeddings  # the popular small models tie theirs
    train = TrainConfig.model_validate({"model": str(local), **run.rl_train})
    env = run.envs[0].settings
    context = model_config.max_position_embeddings
    assert env["max_token_length"] <= run.vllm.max_model_len <= context
    assert train.max_token_length <= run.vllm.max_model_len
    assert train.max_tokens_per_micro_batch >= train.max_token_length  # a row fits
    assert train.batch_size % env["group_size"] == 0
    assert train.dtype == "bfloat16" and train.activation_checkpointing
    with torch.device("meta"):  # the module tree, no memory
        model = AutoModelForCausalLM.from_config(model_config)
    if train.lora is None:  # full weights, synced in memory with the tied head
        assert sync_method(train) == "transfer"
    else:  # the adapter's target modules exist in this architecture
        adapted = apply_lora(model, train.lora)
        trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
        for target in train.lora.target_modules:
            assert any(f".{target}.lora_A" in n for n in trainable), target
