"""Tensor and data parallelism on torch.distributed: process groups, ranks and the
collectives the rank-aware layers call (identity at size 1). Design: docs/scaling.md."""
from pagedllm.distributed.parallel_state import (GroupCoordinator, destroy_model_parallel, get_dp_rank,
                                                 get_dp_size, get_tp_group, get_tp_rank, get_tp_size,
                                                 init_distributed_environment, initialize_model_parallel,
                                                 model_parallel_initialized)
from pagedllm.distributed.utils import divide, kv_head_shard, vocab_shard
from pagedllm.distributed.communication_op import (tensor_model_parallel_all_gather,
                                                   tensor_model_parallel_all_reduce,
                                                   tensor_model_parallel_broadcast)

__all__ = ["GroupCoordinator", "destroy_model_parallel", "get_dp_rank", "get_dp_size", "get_tp_group", "get_tp_rank",
           "get_tp_size", "init_distributed_environment", "initialize_model_parallel",
           "model_parallel_initialized", "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
           "tensor_model_parallel_broadcast", "divide", "kv_head_shard", "vocab_shard"]
