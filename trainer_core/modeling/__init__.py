"""The models a stage trains or uses, and the forwards that score them.

- :mod:`~trainer_core.modeling.models`: build from config or load (HF id, directory, any fsspec
  URI, a LoRA adapter directory), save in Hugging Face format.
- :mod:`~trainer_core.modeling.lora`: LoRA adapters (``peft``): inject, disable for the
  reference, merge on commit.
- :mod:`~trainer_core.modeling.forwards`: every forward (token, pair, reward, completion, the LM
  head's kernels): the LM head on counted tokens only, in chunks, inside any backend's wrapper.
- :mod:`~trainer_core.modeling.architecture`: a model's repeated transformer blocks (what FSDP2
  shards, activation checkpointing recomputes and LoRA adapts).
"""
