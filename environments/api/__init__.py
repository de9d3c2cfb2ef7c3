"""The rollout API (server, client, storage) between environments and the trainer."""
