"""The training engine the worker launches with torchrun: `python -m torch.distributed.run -m fusetune.worker.train`.

Importing this package imports nothing: the Celery side needs only `config.TrainConfig` and `outcome`'s files,
and neither imports torch.
"""
