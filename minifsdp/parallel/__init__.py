"""Chapter 12: beyond data parallelism.

    mappings.py         the collectives of tensor parallelism as conjugate autograd functions (f and g, ...)
    tensor_parallel.py  Megatron-LM's layers, the vocab-parallel loss, sequence parallelism
    tp_gpt.py           TinyGPT split over a tensor-parallel group
    pipeline.py         stages on ranks, micro-batches, the GPipe / 1F1B / interleaved 1F1B schedules
    compose.py          the parallelisms on a mesh: DP x TP, PP x DP (allreduce_gradients after the flush)
"""

from minifsdp.parallel.compose import allreduce_gradients
from minifsdp.parallel.mappings import (copy_to_tensor_model_parallel_region, full_tensor,
                                        gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
                                        reduce_from_tensor_model_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                                        scatter_to_tensor_model_parallel_region)
from minifsdp.parallel.pipeline import (Action, GPTStageModule, PipelineSchedule, PipelineStage, Schedule1F1B,
                                        ScheduleGPipe, ScheduleInterleaved1F1B, gpipe_order, gpt_loss,
                                        interleaved_order, one_f_one_b_order, split_gpt, stages_of_rank)
from minifsdp.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               allreduce_sequence_parallel_grads, column_parallel_linear,
                                               vocab_parallel_cross_entropy)
from minifsdp.parallel.tp_gpt import TensorParallelGPT

__all__ = ["Action", "GPTStageModule", "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "gpipe_order", "gpt_loss", "interleaved_order", "one_f_one_b_order",
           "split_gpt", "stages_of_rank", "allreduce_gradients",
           "ColumnParallelLinear", "RowParallelLinear", "TensorParallelGPT", "VocabParallelEmbedding",
           "allreduce_sequence_parallel_grads", "column_parallel_linear", "copy_to_tensor_model_parallel_region",
           "full_tensor", "gather_from_sequence_parallel_region", "gather_from_tensor_model_parallel_region",
           "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
           "vocab_parallel_cross_entropy"]
