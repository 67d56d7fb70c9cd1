"""The data layer: raw records -> canonical examples -> token ids -> padded batches.

- :mod:`~trainer_core.data.sources`: ``read_records`` from JSONL / Parquet (any fsspec URI) or ``hf://`` ids.
- :mod:`~trainer_core.data.formats`: format detection, SFT / preference / eval-problem adapters,
  answer extraction and matching.
- :mod:`~trainer_core.data.synthetic`: the seeded offline arithmetic task.
- :mod:`~trainer_core.data.tokenizer`: BPE training, loading, chat encoding with a loss mask.
- :mod:`~trainer_core.data.batching`: collation and the resumable length-bucketed sampler.

Submodules are imported explicitly (``from trainer_core.data.batching import collate_causal``)
so that reading records does not import torch or transformers.
"""
