"""The Lachesis trainer: policy updates from batches of scored groups.

``train.py`` is the loop, top to bottom; beside it, its building blocks: ``sources``
(where batches come from: the rollout API, a JSONL file, SFT data), ``batch`` (checks and
tensors), ``advantages`` and ``losses`` (the math), ``distributed`` (data parallelism,
FSDP2), ``checkpoint``, ``metrics``, and ``vllm_sync`` / ``vllm_manager`` (new weights
into the vLLM servers). It imports the data model, the rollout API client and the
inference helpers of ``environments``, nothing else of it.
"""
