"""Environments of other frameworks, run by Lachesis unchanged.

* :mod:`environments.adapters.verifiers_env`: a verifiers (0.4.0, ``verifiers.v1``)
  taskset, ``lachesis env serve verifiers:ID``;
* :mod:`environments.adapters.openenv_env`: an OpenEnv (openenv-core 0.3.0) server,
  ``lachesis env serve openenv:URL``;
* :mod:`environments.adapters.gym_env`: a Gymnasium-style ``reset``/``step`` env (GEM,
  gymnasium, a TextWorld game, any factory), ``lachesis env serve gym:SPEC``.

The first two run the episode with Lachesis's own token-in/token-out agent loop, so the trajectory
holds the exact tokens the policy sampled, and both give one score per assistant turn
(docs/adapters.md says when those are meaningful); the third plays one env step per
assistant turn with its own loop on the same token-in/token-out terms (docs/gym.md).
"""
