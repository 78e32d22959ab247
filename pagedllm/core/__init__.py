"""The engine core: scheduler, KV-cache manager, block pool and the step loop.

The front end reaches it only through ``EngineCore``'s messages (see ``engine/core_client.py``)."""
from pagedllm.core.engine_core import EngineCore

__all__ = ["EngineCore"]
