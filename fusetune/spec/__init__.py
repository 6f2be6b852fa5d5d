"""The job specification, below both the API and the worker: what a job may ask for and what it will run.

- `precision`: the table of precision modes and optimizers (dtypes, state bytes, the MFU peak).
- `examples`: the line formats of training files, parsed the same way at upload and in the trainer.
- `hyperparameters`: the hyperparameters, as requested ("auto") and as decided; every default and bound.
- `methods`: the table of training methods, each with its settings as one model, from which the stored
  specification and the request's `method` are derived.
- `job`: `JobSpec`, a job's method and hyperparameters as its row stores them.
- `estimate`: tokens, peak GPU memory and duration of a job, from its spec and the model's config.json.
- `plan`: `MemoryPlan`, how a job trades memory for time; `planner`: the fastest plan that fits a GPU, what
  would fit when none does, and the disk its checkpoints take.

Nothing here imports torch or any other part of fusetune: the API and the worker import it, never the reverse.
"""
