"""Chapter 13: how long a training step takes, on paper -- per strategy, per model, per cluster.

    from minifsdp.measure import step_time as st
    cluster = st.Cluster(st.H100, nodes=8)
    st.predict("fsdp", st.LLAMA2_7B, cluster, st.Run(seq_len=4096, micro_batch=2))
    # StepTime(step=..., tokens_per_s_per_gpu=..., mfu=..., exposed=...)

Three parts, each small enough to check by hand, and the runs they are checked against:

    alpha_beta.py   collectives, the alpha-beta way: alpha per step of the algorithm (ring or tree), plus the
                    bytes one rank puts on the wire (the counter's ring_bytes) over the bus bandwidth
    cluster.py      the hardware: GPUs, NVLink within a node, NICs between nodes; a collective on a group laid
                    out over nodes (`Cluster.busbw`, `Cluster.collective`)
    transformer.py  compute: a transformer's shape and FLOPs (6*params + 12*layers*d_model*seq_len per token)
    program.py      overlap, from the issue order: a step as a program of compute, collectives and waits, and
                    `simulate`, which runs it on one compute stream and one FIFO channel per process group
    strategies.py   each strategy's program in minifsdp's issue order, and `predict`: step time, tokens/s/GPU,
                    MFU, exposed communication
    published.py    published throughput (`PUBLISHED`) and how far the model is from it (`compare_published`)

`python -m minifsdp step-time` writes the tables (minifsdp/reports/step_time.py), with the calibration of alpha and
beta on this machine. Everything a caller needs is importable from here, as `st.<name>`.
"""

from minifsdp.measure.step_time.alpha_beta import Link, algorithm_steps, alpha_beta, ring_tree_crossover, wire_bytes
from minifsdp.measure.step_time.cluster import (A100, GPU, GPUS, H100, IB_200G, IB_400G, NCCL_ALPHA_NET,
                                                NCCL_ALPHA_NVLINK, NCCL_TREE_ALPHA_NET, NCCL_TREE_ALPHA_NVLINK,
                                                Cluster, Group, nic)
from minifsdp.measure.step_time.program import (Collective, Compute, Simulated, Wait, issue_sequence,
                                                program_from_recording, recorded_sequence, simulate)
from minifsdp.measure.step_time.published import (NOT_FOUND, PUBLISHED, SOURCES, Published, Source,
                                                  calibrate_efficiency, compare_published, predict_published,
                                                  published_cluster)
from minifsdp.measure.step_time.strategies import (ADAM_BYTES_PER_PARAM, STRATEGIES, STRATEGY_NAMES, Run, StepTime,
                                                   Unit, data_parallel_program, fsdp_program, hiding_threshold,
                                                   optimizer_seconds, predict, programs, units)
from minifsdp.measure.step_time.transformer import (LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B, MODELS,
                                                    MPT_7B, MPT_13B, MPT_30B, MPT_70B, Transformer)

__all__ = ["Link", "algorithm_steps", "alpha_beta", "ring_tree_crossover", "wire_bytes",
           "A100", "GPU", "GPUS", "H100", "IB_200G", "IB_400G", "NCCL_ALPHA_NET", "NCCL_ALPHA_NVLINK",
           "NCCL_TREE_ALPHA_NET", "NCCL_TREE_ALPHA_NVLINK", "Cluster", "Group", "nic",
           "Collective", "Compute", "Simulated", "Wait", "issue_sequence", "program_from_recording",
           "recorded_sequence", "simulate",
           "NOT_FOUND", "PUBLISHED", "SOURCES", "Published", "Source", "calibrate_efficiency", "compare_published",
           "predict_published", "published_cluster",
           "ADAM_BYTES_PER_PARAM", "STRATEGIES", "STRATEGY_NAMES", "Run", "StepTime", "Unit", "data_parallel_program",
           "fsdp_program", "hiding_threshold", "optimizer_seconds", "predict", "programs", "units",
           "LLAMA2_7B", "LLAMA2_13B", "LLAMA2_70B", "LLAMA3_8B", "LLAMA3_70B", "MODELS", "MPT_7B", "MPT_13B",
           "MPT_30B", "MPT_70B", "Transformer"]
