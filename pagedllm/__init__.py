"""pagedllm: an LLM inference and serving engine with a paged KV cache, continuous
batching, chunked prefill and prefix caching."""
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
