"""Chapter 13: published throughput of FSDP runs, and how far the model is from it.

Each row of `PUBLISHED` is one configuration of a published table, cited to its repository, file and commit, with
what the source states and what was assumed where it does not. The compute efficiency of each GPU is fitted to one
row (`calibration=True`, `calibrate_efficiency`) and held fixed for every other: those are predictions.
`compare_published` sets each row next to the model's prediction; `python -m minifsdp step-time --published`
writes the table (minifsdp/reports/step_time.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minifsdp.measure.step_time.alpha_beta import Link
from minifsdp.measure.step_time.cluster import A100, GPU, H100, IB_200G, IB_400G, Cluster
from minifsdp.measure.step_time.strategies import Run, StepTime, predict
from minifsdp.measure.step_time.transformer import (LLAMA2_13B, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B, MPT_7B, MPT_13B,
                                                    MPT_30B, MPT_70B, Transformer)


@dataclass(frozen=True)
class Source:
    name: str
    repo: str
    path: str
    commit: str
    setup: str    # the setup, as the source states it
    assumed: str  # what the source does not state, and what we assumed instead

    @property
    def citation(self) -> str:
        return f"{self.repo}, {self.path} @ {self.commit[:9]}"


TORCHTITAN_A100 = Source(
    "torchtitan (A100)", "pytorch/torchtitan", "docs/performance.md", "157a12c562288b3bccb077003a97f18a4ca657aa",
    "64 A100 80 GB, FSDP2 (fully_shard per block), 1D; bf16 compute, fp32 gradient reduction; no torch.compile, "
    "no Float8. Sequence length 8192 (Llama 3) and 4096 (Llama 2), from the train configs at that commit. MFU "
    "counted as 6 x all parameters + 12 L h q t (torchtitan/utils.py at that commit): our convention",
    "The network is not stated: 8 x 200 Gb/s per node assumed. 'selective layer' taken as every 2nd block "
    "checkpointed; 'selective op' as the op policy of that commit (every 2nd matmul recomputed)")
TORCHTITAN_H100 = Source(
    "torchtitan (H100)", "pytorch/torchtitan", "docs/performance.md", "d4c86e3758a84cf23e2e879ab3c995cba9d5e410",
    "Grand Teton hosts: 8 H100 (96 GB HBM2e, 500 W power limit) with NVLink, 400 Gb/s RDMA per GPU. FSDP2, "
    "local batch 2 x 8192 tokens, selective AC. Tables 1 (8 GPUs) and 3 (128 GPUs), the rows without "
    "torch.compile and Float8. No MFU in the table (the text gives 33-39% for these runs)",
    "Selective AC taken as the op policy (the train config's default). These H100s run at 500 W with HBM2e: "
    "slower than the H100 SXM whose efficiency we calibrated, which the source itself notes")
LLM_FOUNDRY = "mosaicml/llm-foundry", "scripts/train/benchmarking/README.md", "495218376830947dce625efabc4d86be7c47cc45"
LLM_FOUNDRY_H100 = Source(
    "llm-foundry (H100)", *LLM_FOUNDRY,
    "MPT models under Composer's FSDP1 (FULL_SHARD, one unit per block, limit_all_gathers), amp_bf16 with "
    "mixed precision DEFAULT (fp32 gradient reduction), FlashAttention; tables 'H100 80GB BF16' and "
    "'H100 80GB BF16 (Large Scale, >= 128 GPUs)'. MFU counted as 6 x all parameters + 12 L d s: our convention",
    "The network is not stated: 8 x 400 Gb/s per node assumed. Backward prefetch: Composer's default "
    "(BACKWARD_POST); no_sync on every micro-batch but the last (Composer's default sync strategy)")
LLM_FOUNDRY_A100 = Source(
    "llm-foundry (A100)", *LLM_FOUNDRY,
    "The table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)': as for H100, mixed precision DEFAULT, "
    "or PURE (bf16 gradient reduction) for the 70b rows",
    "8 x 200 Gb/s per node (the stated 1,600 Gb/s); the rest as for H100")
SOURCES = (TORCHTITAN_A100, TORCHTITAN_H100, LLM_FOUNDRY_H100, LLM_FOUNDRY_A100)


@dataclass(frozen=True)
class Published:
    source: Source
    table: str                   # where in the source
    label: str                   # the row, as the source names its configuration
    model: Transformer
    gpu: GPU
    gpus: int
    nic: Link
    run: Run
    tokens_per_s_per_gpu: float  # as published
    mfu: float | None            # as published (a fraction); None where the source gives none
    calibration: bool = False    # the row the GPU's efficiency was fitted to
    lacks: str = ""              # what the published run has that the model does not


_TT_RUN = dict(param_bytes=2, grad_bytes=4, forward_prefetch=True, backward_prefetch="pre")
_MPT_RUN = dict(param_bytes=2, forward_prefetch=True, backward_prefetch="post", sync_each_microbatch=False)
_FLASH = "FlashAttention with a causal mask computes half the attention FLOPs counted"


def _tt(table, label, model, seq, gpus, mb, ac, tps, mfu, gpu=A100, nic_=IB_200G, source=TORCHTITAN_A100):
    return Published(source, table, label, model, gpu, gpus, nic_,
                     Run(seq_len=seq, micro_batch=mb, ac=ac, **_TT_RUN), tps, mfu,
                     lacks="FlashAttention (SDPA) with a causal mask computes half the attention FLOPs counted")


def _mpt(table, model, seq, gpus, mb, ga, ac, tps, mfu, gpu=H100, nic_=IB_400G, grad_bytes=4, calibration=False):
    source = LLM_FOUNDRY_H100 if gpu is H100 else LLM_FOUNDRY_A100
    label = (f"{model.name.split()[1].lower()}, seq {seq}, {gpus} GPUs, micro-batch {mb} x {ga} accumulated, "
             f"{'full AC' if ac == 'full' else 'no AC'}")
    return Published(source, table, label, model, gpu, gpus, nic_,
                     Run(seq_len=seq, micro_batch=mb, grad_accum=ga, ac=ac, grad_bytes=grad_bytes, **_MPT_RUN),
                     tps, mfu / 100, calibration=calibration, lacks=_FLASH)


_H100_BIG = "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
_H100_TAB = "H100 80GB BF16"
_A100_TAB = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
_A100, _F = dict(gpu=A100, nic_=IB_200G), "full"

# The rows: every bf16 row of torchtitan's tables at the two commits that uses neither torch.compile nor Float8;
# every bf16 row of llm-foundry's H100 and A100-80GB tables for the 7b-70b models at sequence lengths up to 8192.
# (The A100-40GB table repeats the A100 with smaller micro-batches and is left out.) Numbers copied from the
# sources; `calibration=True` marks the one row per GPU the efficiency was fitted to.
PUBLISHED = [
    _tt("Llama 3, 64 A100", "Llama 3 8B, batch 1, selective layer AC", LLAMA3_8B, 8192, 64, 1, "every_2nd",
        2904, 0.568),
    _tt("Llama 3, 64 A100", "Llama 3 8B, batch 1, selective op AC", LLAMA3_8B, 8192, 64, 1, "selective_op",
        2973, 0.582),
    _tt("Llama 3, 64 A100", "Llama 3 70B, batch 1, full AC", LLAMA3_70B, 8192, 64, 1, "full", 331, 0.517),
    _tt("Llama 2, 64 A100", "Llama 2 13B, batch 2, no AC", LLAMA2_13B, 4096, 64, 2, "none", 2162, 0.611),
    _tt("Llama 2, 64 A100", "Llama 2 13B, batch 2, selective layer AC", LLAMA2_13B, 4096, 64, 2, "every_2nd",
        1914, 0.541),
    _tt("Llama 2, 64 A100", "Llama 2 13B, batch 2, selective op AC", LLAMA2_13B, 4096, 64, 2, "selective_op",
        1904, 0.538),
    _tt("Llama 2, 64 A100", "Llama 2 70B, batch 1, selective op AC", LLAMA2_70B, 4096, 64, 1, "selective_op",
        355, 0.508),
    _tt("Llama 2, 64 A100", "Llama 2 70B, batch 2, full AC", LLAMA2_70B, 4096, 64, 2, "full", 353, 0.505),
    _tt("Table 1", "Llama 3.1 8B, 8 GPUs, FSDP", LLAMA3_8B, 8192, 8, 2, "selective_op", 5762, None,
        gpu=H100, nic_=IB_400G, source=TORCHTITAN_H100),
    _tt("Table 3", "Llama 3.1 8B, 128 GPUs, FSDP", LLAMA3_8B, 8192, 128, 2, "selective_op", 5605, None,
        gpu=H100, nic_=IB_400G, source=TORCHTITAN_H100),
    _mpt(_H100_BIG, MPT_70B, 2048, 512, 8, 1, _F, 1007, 41.25),
    _mpt(_H100_BIG, MPT_70B, 2048, 256, 8, 1, _F, 1035, 42.42),
    _mpt(_H100_BIG, MPT_70B, 2048, 128, 8, 1, _F, 1058, 43.36),
    _mpt(_H100_BIG, MPT_30B, 2048, 512, 8, 1, _F, 2115, 40.27),
    _mpt(_H100_BIG, MPT_30B, 2048, 256, 8, 1, _F, 2148, 40.89),
    _mpt(_H100_BIG, MPT_30B, 2048, 128, 8, 1, _F, 2199, 41.85),
    _mpt(_H100_BIG, MPT_13B, 2048, 512, 16, 1, _F, 4952, 41.12),
    _mpt(_H100_BIG, MPT_13B, 2048, 256, 16, 1, _F, 4989, 41.42),
    _mpt(_H100_BIG, MPT_13B, 2048, 128, 16, 1, _F, 5080, 42.18),
    _mpt(_H100_BIG, MPT_7B, 2048, 512, 6, 1, "none", 9670, 42.2),
    _mpt(_H100_BIG, MPT_7B, 2048, 256, 6, 1, "none", 10119, 44.15),
    _mpt(_H100_BIG, MPT_7B, 2048, 128, 6, 1, "none", 10475, 45.71),
    _mpt(_H100_TAB, MPT_70B, 2048, 64, 8, 4, _F, 1039, 42.57),
    _mpt(_H100_TAB, MPT_70B, 2048, 32, 2, 16, _F, 882, 36.15),
    _mpt(_H100_TAB, MPT_30B, 8192, 8, 1, 21, _F, 1384, 29.92),
    _mpt(_H100_TAB, MPT_30B, 4096, 8, 1, 21, _F, 1802, 35.86),
    _mpt(_H100_TAB, MPT_30B, 2048, 32, 14, 3, _F, 2308, 43.92),
    _mpt(_H100_TAB, MPT_30B, 2048, 16, 10, 3, _F, 2263, 43.07),
    _mpt(_H100_TAB, MPT_30B, 2048, 8, 3, 21, _F, 2002, 38.11),
    _mpt(_H100_TAB, MPT_30B, 1024, 8, 6, 21, _F, 2084, 38.76),
    _mpt(_H100_TAB, MPT_13B, 4096, 8, 10, 3, _F, 4717, 41.6),
    _mpt(_H100_TAB, MPT_13B, 2048, 64, 2, 1, "none", 4800, 39.86),
    _mpt(_H100_TAB, MPT_13B, 2048, 32, 2, 1, "none", 4811, 39.95),
    _mpt(_H100_TAB, MPT_13B, 2048, 16, 2, 1, "none", 4767, 39.58),
    _mpt(_H100_TAB, MPT_13B, 2048, 8, 2, 1, "none", 4792, 39.79),
    _mpt(_H100_TAB, MPT_13B, 1024, 8, 40, 3, _F, 5502, 44.27),
    _mpt(_H100_TAB, MPT_7B, 8192, 8, 8, 2, _F, 6935, 37.14),
    _mpt(_H100_TAB, MPT_7B, 4096, 8, 16, 2, _F, 8611, 40.42),
    _mpt(_H100_TAB, MPT_7B, 2048, 8, 6, 1, "none", 10643, 46.44, calibration=True),
    _mpt(_H100_TAB, MPT_7B, 1024, 8, 64, 2, _F, 10203, 42.83),
    _mpt(_A100_TAB, MPT_70B, 2048, 64, 8, 4, _F, 410, 53.33, grad_bytes=2, **_A100),
    _mpt(_A100_TAB, MPT_70B, 2048, 32, 2, 16, _F, 373, 48.56, grad_bytes=2, **_A100),
    _mpt(_A100_TAB, MPT_30B, 8192, 8, 1, 21, _F, 574, 39.38, **_A100),
    _mpt(_A100_TAB, MPT_30B, 4096, 8, 1, 21, _F, 814, 51.37, **_A100),
    _mpt(_A100_TAB, MPT_30B, 2048, 8, 3, 21, _F, 916, 55.3, **_A100),
    _mpt(_A100_TAB, MPT_30B, 1024, 8, 6, 21, _F, 946, 55.82, **_A100),
    _mpt(_A100_TAB, MPT_30B, 512, 8, 12, 21, _F, 967, 56.4, **_A100),
    _mpt(_A100_TAB, MPT_13B, 8192, 8, 5, 3, _F, 1795, 56.07, **_A100),
    _mpt(_A100_TAB, MPT_13B, 4096, 8, 10, 3, _F, 2060, 57.62, **_A100),
    _mpt(_A100_TAB, MPT_13B, 2048, 8, 2, 3, "none", 2262, 59.57, **_A100),
    _mpt(_A100_TAB, MPT_13B, 1024, 8, 40, 3, _F, 2330, 59.48, **_A100),
    _mpt(_A100_TAB, MPT_7B, 8192, 8, 8, 2, _F, 3206, 54.47, **_A100),
    _mpt(_A100_TAB, MPT_7B, 4096, 8, 16, 2, _F, 3684, 54.84, **_A100),
    _mpt(_A100_TAB, MPT_7B, 2048, 8, 6, 2, "none", 4641, 64.23, calibration=True, **_A100),
    _mpt(_A100_TAB, MPT_7B, 1024, 8, 64, 2, _F, 4357, 58.01, **_A100),
]
# Left out of the table: runs whose settings (micro-batch, sequence length, checkpointing, network) the stored
# sources do not give, so the model cannot be run on them -- the FSDP paper's (Zhao et al., VLDB 2023) scaling
# runs, which chapter 13 quotes beside the model instead; the ZeRO paper's (Rajbhandari et al., SC 2020)
# throughput tables; and Megatron-LM's MFU tables (whose runs use tensor and pipeline parallelism).
NOT_FOUND = ("the FSDP paper (Zhao et al., VLDB 2023), its scaling runs (chapter 13 quotes what it reports)",
             "the ZeRO paper (Rajbhandari et al., SC 2020), its throughput tables",
             "Megatron-LM's MFU tables (runs with tensor and pipeline parallelism, which this model lacks)")


def published_cluster(row: Published, gpu: GPU | None = None) -> Cluster:
    return Cluster(gpu or row.gpu, nodes=max(1, row.gpus // 8), gpus_per_node=min(8, row.gpus), nic=row.nic)


def predict_published(row: Published, gpu: GPU | None = None) -> StepTime:
    return predict("fsdp", row.model, published_cluster(row, gpu), row.run)


def calibrate_efficiency(row: Published) -> float:
    """The compute efficiency at which the model predicts `row`'s published tokens/s exactly."""
    lo, hi = 0.05, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        tps = predict_published(row, replace(row.gpu, efficiency=mid)).tokens_per_s_per_gpu
        lo, hi = (mid, hi) if tps < row.tokens_per_s_per_gpu else (lo, mid)
    return (lo + hi) / 2


def compare_published(rows=None) -> list[dict]:
    """Each published row next to the model's prediction, with the relative error of the prediction."""
    out = []
    for row in PUBLISHED if rows is None else rows:
        p = predict_published(row)
        out.append(dict(row=row, predicted=p.tokens_per_s_per_gpu, predicted_mfu=p.mfu,
                        error=p.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu - 1,
                        exposed=p.exposed / p.step))
    return out
