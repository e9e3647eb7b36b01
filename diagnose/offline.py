"""diagnose never reaches the network at run time: its own process keeps the Hugging Face
libraries offline, and the user's trainer keeps the environment the user gave it.

Models are built from configs and nothing is downloaded, yet a library may reach out on its own:
bitsandbytes, on a CPU with AVX-512 BF16, asks the ``kernels`` package at import for a kernel
from the Hugging Face hub (a DNS lookup and a download attempt, then a warning when it fails).
The hub's offline switches make every such call fail at once, without a connection. They are on
for the duration of a command (:func:`hub_offline`), before anything heavy is imported, whatever
the user set; a command the user asked diagnose to run (``diagnose profile -- CMD``) and the
record's list of environment variables get the environment as the user gave it
(:func:`user_environ`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: huggingface_hub (and the libraries on it: diffusers, peft, kernels) read HF_HUB_OFFLINE;
#: transformers and datasets have switches of their own besides.
HUB_OFFLINE: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}

#: While :func:`hub_offline` holds: each switch it set, with the user's value (None: unset).
_users: dict[str, str | None] = {}


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The hub's offline switches on for the duration, then the environment as it was."""
    changed = {
        name: os.environ.get(name)
        for name, value in HUB_OFFLINE.items()
        if os.environ.get(name) != value and name not in _users
    }
    for name in changed:
        os.environ[name] = HUB_OFFLINE[name]
    _users.update(changed)
    try:
        yield
    finally:
        for name, before in changed.items():
            _users.pop(name, None)
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def user_environ() -> dict[str, str]:
    """The environment as the user gave it: :data:`os.environ` with the switches
    :func:`hub_offline` set put back as they were."""
    env = dict(os.environ)
    for name, before in _users.items():
        if before is None:
            env.pop(name, None)
        else:
            env[name] = before
    return env


__all__ = ["HUB_OFFLINE", "hub_offline", "user_environ"]
