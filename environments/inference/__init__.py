"""Inference: vLLM server processes and clients, chat rendering, generation backends."""
