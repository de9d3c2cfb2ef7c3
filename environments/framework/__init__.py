"""The env framework: ``BaseEnv`` and its hooks (``base``), the multi-turn agent loop
(``agent_loop``), reward functions (``rewards``), tools (``tools``, and tools that run in a
sandbox: ``sandbox_tools``), running an env (``runner``: process to JSONL, serve to the
rollout API) and delivering its groups (``delivery``), the env registry (``registry``) and
epoch-by-epoch item order (``item_order``).

It builds on the layers below it (the data model, the rollout API client, inference and
sandboxes) and is imported by the environments in ``environments.envs``.
"""
