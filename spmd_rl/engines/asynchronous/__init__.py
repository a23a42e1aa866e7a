"""The async engine (`engine.class: async`), one folder: the loops (engine.py), its inference server
(inference_server.py: the threads that answer whichever env ranks have sent) and its config section (config.py,
free of torch so that `--help` and config errors answer without importing the engine). Its messages' layouts are
in roles/messages.py with every other message's.

`spmd_rl.engines.asynchronous:AsyncEngine` names the engine as before; it is imported on first use, so importing
the config section alone stays cheap."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "AsyncEngine":
        from spmd_rl.engines.asynchronous.engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
