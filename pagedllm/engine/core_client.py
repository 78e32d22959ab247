"""EngineCoreClient: the front end's only way to the engine core (vLLM V1's shape).

Everything that crosses it is a message from ``pagedllm/messages.py`` or a plain value,
so an implementation that runs the core in another process (over ZMQ, msgspec-encoded)
can stand in for ``InprocClient`` without either side changing.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.messages import EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCoreClient(ABC):
    """Attributes:
        info: what the core reported once started (final max_model_len, KV blocks, ...).
    """

    info: EngineCoreInfo

    @staticmethod
    def make_client(config: EngineConfig) -> EngineCoreClient:
        """The client for ``config`` (today the in-process one; loads the model)."""
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request."""

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """Run (or wait for) one engine step and return its outputs."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        """Abort requests; their KV blocks are freed. Returns their final outputs."""

    @abstractmethod
    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds; returns how many."""

    @abstractmethod
    def get_scheduler_stats(self) -> SchedulerStats:
        """The scheduler's statistics now (for a caller with no step to read them from)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core and release its resources."""


class InprocClient(EngineCoreClient):
    """The core in this process, called directly. ``engine_core`` is for tests and
    in-process tools only; the front end never reaches through it."""

    def __init__(self, config: EngineConfig):
        from pagedllm.core import EngineCore

        self.engine_core = EngineCore(config)
        self.info = self.engine_core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def abort_requests(self, request_ids: list[str]) -> EngineCoreOutputs:
        return self.engine_core.abort_requests(request_ids)

    def reset_prefix_cache(self) -> int:
        return self.engine_core.reset_prefix_cache()

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.engine_core.get_scheduler_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
