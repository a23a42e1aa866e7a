"""The async engine (`engine.class: async`), one folder: the loops (engine.py), its inference server
(serving_threads.py: the threads that answer whichever env ranks have sent) and its config section (config.py,
free of torch so that `--help` and config errors answer without importing the engine). Its messages' layouts are
in roles/messages.py with every other message's.

`spmd_rl.engines.asynchronous:AsyncEngine` names the engine as before; it is imported on first use, so importing
the config section alone stays cheap."""

from __future__ import annotations

from typing import Any

from spmd_rl.runtime.lazy_names import import_lazily

_LAZY = {"AsyncEngine": "spmd_rl.engines.asynchronous.engine"}


def __getattr__(name: str) -> Any:
    return import_lazily(globals(), _LAZY, __name__, name)
