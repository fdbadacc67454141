"""The one place conveyor's Python reads the environment (docs/environment.md lists every
variable; common/env.cc is the C++ side's one place). Every read goes through `variable`,
so a name read anywhere is one `grep 'environment.variable("'` away."""
from __future__ import annotations

import os

__all__ = ["variable", "is_set", "set_default"]


def variable(name: str, default: str | None = None) -> str | None:
    """The value of environment variable `name`, or `default` where it is unset."""
    return os.environ.get(name, default)


def is_set(name: str) -> bool:
    return name in os.environ


def set_default(name: str, value: str) -> None:
    """Sets `name` for this process (and the processes it starts) where it is unset."""
    os.environ.setdefault(name, value)
