"""``lachesis run CONFIG``: the whole system (rollout API, vLLM, env servers, trainer) as
supervised processes of one run under ``runs/NAME/``."""
