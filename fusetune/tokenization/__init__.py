"""Training examples as tokens and loss masks, below both the API and the worker, with no torch.

- `masks`: an example through the model's tokenizer and chat template, with the tokens its loss is on and the
  completion each trained assistant turn would be when served.
- `check`: the data check on those masks (the end-of-turn token trained, no prompt token trained, the served
  form), per line format, and the preview of an example with its trained spans marked.
- `tokenizer`: a model folder's tokenizer loaded without torch, and the tokens that stop its generation.

The trainer (fusetune/worker/train/data.py) makes its rows of these masks and the API checks a job's files with
them before creating the job, so the two cannot disagree. Imports only fusetune.spec of the rest of fusetune.
"""
