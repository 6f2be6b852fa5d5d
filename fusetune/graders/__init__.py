"""Grading sampled completions with OpenAI's graders (the objects are in fusetune/spec/graders.py).

- `grading`: `grade`, `grade_many`, `GradeResult`, `Sample`, `check_grader`, which refuses what this server
  cannot run before anything is graded, and `preflight_grader`, which tries a job's templates on its first lines.
- `templates`: `{{ item.* }}` and `{{ sample.* }}` substitution.
- `similarity`: the text_similarity metrics (rapidfuzz, sacrebleu, nltk, rouge-score).
- `sandbox` and `sandbox_runner`: python graders, each sample in a process shut in by namespaces, Landlock,
  seccomp and rlimits (the README's "Graders" section says what each stops, and what it does not).

No torch here: the API grades one sample for `POST /v1/fine_tuning/alpha/graders/run`, the trainer a step's.
"""

from fusetune.graders.grading import GradeResult, Sample, check_grader, grade, grade_many, preflight_grader

__all__ = ["GradeResult", "Sample", "check_grader", "grade", "grade_many", "preflight_grader"]
