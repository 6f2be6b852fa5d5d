"""A run's checkpoints, in one place: how they are written, recorded, restored and pruned, on local disk and in
the object store alike.

- `layout.py`: the folder `output_dir/checkpoints/step-<n>/`, its files, listing, staging and deletion (no torch).
- `schedule.py`: when a run saves a resumable checkpoint before its final one (no torch).
- `state.py`: `resume.pt`, the training state beside the weights: the data position, every rank's RNG states,
  what the run depends on, its format; the optimizer's state file; where a run resumes from.
- `checkpointer.py`: the trainer's save (write, publish, record in SQL, prune) and the optimizer's restore.
- `store.py`: the object store (FUSETUNE_STORAGE_URL): the trainer publishes a checkpoint before it is recorded;
  the worker restores the recorded ones before a run and removes the unrecorded ones after it (no torch).

The Celery side imports `layout` and `store` from here; nothing here imports the Celery side. This file
imports nothing, so that those two stay free of torch.
"""
