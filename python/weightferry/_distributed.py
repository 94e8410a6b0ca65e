"""Where the ranks of a distributed session meet when torch.distributed already runs a process group: the ranks agree
on a rendezvous port through torch's store."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from . import _core

if TYPE_CHECKING:
    from ._config import ConfigFormat

__all__ = ["rendezvous_port"]

# Numbers the distributed sessions this process opens: each one's rendezvous port has its own key in torch's store
# (every rank enables in the same order, so the n-th enable of every rank reads the same key).
_SESSION_NUMBERS = itertools.count(1)


def rendezvous_port(text: str, fmt: ConfigFormat) -> int | None:
    """Where the ranks of a distributed session meet, when torch.distributed already runs a process group: its
    store holds ``MASTER_PORT``, so rank 0 picks a free port, publishes it in that store, and every rank reads it
    there. ``None`` (weightferry's rendezvous listens on ``MASTER_PORT``) without a process group, or when the config
    gathers nothing."""
    if not _core.check_config(text, fmt).startswith("distributed"):
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    import socket

    store = dist.distributed_c10d._get_default_store()
    key = f"weightferry/rendezvous/{next(_SESSION_NUMBERS)}"
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            store.set(key, str(s.getsockname()[1]))
    return int(store.get(key).decode())
