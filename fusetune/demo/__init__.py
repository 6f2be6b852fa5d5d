"""The demo's task, tiny model and data (see task.py and assets.py).

Loading or building a model through transformers imports torchao whenever it is installed (its quantizer
table), and torchao 0.18, the version pyproject allows, registers two of its enums (KernelPreference,
ScaleCalculationMode) as pytree constants at import. torch 2.14 treats enums natively and logs a deprecation
warning for each registration: two lines of noise at the demo's start, and at `fusetune serve`'s first start
while it builds the bundled model, that nobody can act on. The filter below drops those records of torch's
pytree logger, and no other; it can go once torchao stops registering enums.
"""

from __future__ import annotations

import logging


def _not_an_enum_registration(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_not_an_enum_registration)
