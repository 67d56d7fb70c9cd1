"""The loops: supervised (:mod:`~trainer_core.training.loop`, with the SFT, reward-model and DPO
objectives in :mod:`~trainer_core.training.supervised`) and online RL
(:mod:`~trainer_core.training.rl.trainer`). Both checkpoint through one
:class:`~trainer_core.checkpoint.session.CheckpointSession`; neither knows about stages, specs
or Prefect.
"""
