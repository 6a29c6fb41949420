"""Chapter 12: beyond data parallelism.

    mappings.py         the collectives of tensor parallelism as conjugate autograd functions (f and g, ...)
    tensor_parallel.py  Megatron-LM's column and row layers, the async input-gradient all-reduce, sequence parallelism
    vocab_parallel.py   the vocabulary split: the vocab-parallel embedding and cross-entropy
    tp_gpt.py           TinyGPT split over a tensor-parallel group
    pipeline_stage.py   TinyGPT cut into stages between its layers; what a stage keeps between forward and backward
    pipeline_orders.py  the GPipe / 1F1B / interleaved 1F1B orders of actions, and where the bubble comes from
    pipeline.py         the schedules: a rank's stages run through their order, the messages between ranks
    compose.py          the parallelisms on a mesh: DP x TP, PP x DP (allreduce_gradients after the flush)
"""

from minifsdp.parallel.compose import allreduce_gradients
from minifsdp.parallel.mappings import (copy_to_tensor_model_parallel_region, full_tensor,
                                        gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
                                        reduce_from_tensor_model_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                                        scatter_to_tensor_model_parallel_region)
from minifsdp.parallel.pipeline import PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from minifsdp.parallel.pipeline_orders import Action, gpipe_order, interleaved_order, one_f_one_b_order, stages_of_rank
from minifsdp.parallel.pipeline_stage import GPTStageModule, PipelineStage, gpt_loss, split_gpt
from minifsdp.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               allreduce_sequence_parallel_grads, column_parallel_linear)
from minifsdp.parallel.tp_gpt import TensorParallelGPT
from minifsdp.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["Action", "GPTStageModule", "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "gpipe_order", "gpt_loss", "interleaved_order", "one_f_one_b_order",
           "split_gpt", "stages_of_rank", "allreduce_gradients",
           "ColumnParallelLinear", "RowParallelLinear", "TensorParallelGPT", "VocabParallelEmbedding",
           "allreduce_sequence_parallel_grads", "column_parallel_linear", "copy_to_tensor_model_parallel_region",
           "full_tensor", "gather_from_sequence_parallel_region", "gather_from_tensor_model_parallel_region",
           "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region",
           "vocab_parallel_cross_entropy"]
