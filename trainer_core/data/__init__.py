"""The data layer: raw records -> canonical examples -> token ids -> padded batches.

- :mod:`~trainer_core.data.sources`: ``iter_records`` (streamed) / ``read_records`` from JSONL /
  Parquet (any fsspec URI) or ``hf://`` ids.
- :mod:`~trainer_core.data.formats`: format detection, SFT / preference / eval-problem adapters,
  answer extraction and matching.
- :mod:`~trainer_core.data.synthetic`: the seeded offline arithmetic task.
- :mod:`~trainer_core.data.tokenizer`: BPE training, loading, chat encoding with a loss mask.
- :mod:`~trainer_core.data.staging`: prepare_data's canonical examples on local disk, and the
  seeded split by index.
- :mod:`~trainer_core.data.encode`, :mod:`~trainer_core.data.parallel`: tokenising chunks of
  examples, in order, in worker processes.
- :mod:`~trainer_core.data.shards`: the Parquet shards of a prepared split and their writer.
- :mod:`~trainer_core.data.prepared`: reading prepared splits, memory-mapped, as lazy rows.
- :mod:`~trainer_core.data.samplers`: the resumable length-bucketed and packed samplers.
- :mod:`~trainer_core.data.batching`: collation (padded and packed).

Submodules are imported explicitly (``from trainer_core.data.batching import collate_causal``)
so that reading records does not import torch or transformers.
"""
