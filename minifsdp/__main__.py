"""The command line:

    python -m minifsdp tour [--world-size 2] [--steps 5] [--strategies ...]  every strategy, side by side
    python -m minifsdp memory [--strategies ddp oss sdp] [--world-sizes 1 2 3 4]   memory vs the model
    python -m minifsdp partition [--world-sizes 2 3 4 5 6 7 8]             chapter 3: load balance of partitions
    python -m minifsdp grad-buffers [--world-size 2]                        chapter 5: gradient bytes of one unit's backward
    python -m minifsdp units [--world-size 2]                               chapter 6: FSDP units and payloads
    python -m minifsdp phases [--world-sizes 1 2 3 4]                       chapter 6: memory at each phase
    python -m minifsdp embedding-units [--world-size 2]                     chapter 6: untied embedding and head as units
    python -m minifsdp timeline [--world-size 2]                           chapter 7: one step per prefetch mode
    python -m minifsdp prefetch-memory [--world-sizes 2 4]                  chapter 7: what prefetching costs
    python -m minifsdp precision [--world-size 2]                           chapter 8: memory and bytes per precision
    python -m minifsdp fp32-modules [--world-size 2]                        chapter 8: LayerNorms kept in fp32 vs torch's FSDP1
    python -m minifsdp options [--world-size 2]                             chapter 9: accumulation, checkpointing, init
    python -m minifsdp accumulation [--world-size 2]                        chapter 9: accumulation per sharding strategy
    python -m minifsdp checkpoints [--world-sizes 1 2 3 4]                  chapter 10: checkpoint size and time
    python -m minifsdp state-dict-memory [--world-sizes 2 4]                chapter 10: the memory of a full state dict
    python -m minifsdp fsdp2 [--world-sizes 2 4]                            chapter 11: FlatParameter vs fully_shard vs torch's
    python -m minifsdp parallel [--parts tp overlap pp compare] [--plot P]  chapter 12: TP and SP, TP's overlap, PP, TP vs PP vs DP
    python -m minifsdp parity [--world-sizes 1 2 3 4]                       chapter 6: parity of every strategy vs torch
    python -m minifsdp gpu-check [--markdown PATH]                          every strategy on NCCL (GPUs only)
    python -m minifsdp step-time [--models 7b 70b] [--nodes 1 8]          chapter 13: the alpha-beta step-time model
    python -m minifsdp simulate [--model 7b] [--world-size 1024]            chapter 13: rank 0 of N, on meta tensors
    python -m minifsdp demo [--world-size 3]                                all-reduce = reduce-scatter + all-gather
    python -m minifsdp student OUT_DIR [--only 1.2] [--chapters 6,7] [--pass-line 60]   a student copy, solutions removed
    python -m minifsdp grade [PATH] [--reference REF] [--chapters 6,7]      score a submission on the course's tests
                       [--json F] [--gradescope F] [--junit DIR] [--timeout S] [--pass-line P]
    python -m minifsdp grade-all DIR [--chapters 6,7] [--out grades]        every submission in DIR; summary.csv

`minifsdp ...` (the console script) is the same. The tour also runs under torchrun:

    torchrun --nproc-per-node 2 -m minifsdp tour
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line: every subcommand and its options (the docs' commands are checked against it)."""
    parser = argparse.ArgumentParser(prog="minifsdp", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tour = sub.add_parser("tour", help="train the tour GPT under every strategy and compare them")
    tour.add_argument("--world-size", type=int, default=2)
    tour.add_argument("--steps", type=int, default=5)
    tour.add_argument("--strategies", nargs="+", default=None, help="a few of them (default: all)")
    tour.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    tour.add_argument("--plot", default="tour_memory.svg", help="where to write the memory plot (.svg or .png)")
    tour.add_argument("--plot-world-size", type=int, default=None,
                      help="measure the plot at this many ranks (default: the tour's --world-size)")
    tour.add_argument("--markdown", default=None, help="also write the tables as Markdown to this file")

    memory = sub.add_parser("memory", help="chapter 2: DDP's per-rank memory and traffic vs the analytic model")
    memory.add_argument("--strategies", nargs="+", default=["ddp"], help="from: ddp oss sdp ...")
    memory.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    memory.add_argument("--steps", type=int, default=6)
    memory.add_argument("--plot", default="ddp_memory.svg")
    memory.add_argument("--markdown", default=None)
    memory.add_argument("--model", default="tour", choices=["tour", "states-heavy"],
                        help="the tour GPT, or a GPT whose model states outweigh its activations (chapter 4)")
    memory.add_argument("--bars", default="after_step", choices=["after_step", "peak"],
                        help="plot the states after the step (peak as a dot), or memory by category at the peak")

    part = sub.add_parser("partition", help="chapter 3: load balance of the greedy, by-order and flat partitions")
    part.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    part.add_argument("--markdown", default=None)

    gb = sub.add_parser("grad-buffers", help="chapter 5: the gradient bytes alive at once around one unit's backward "
                                             "and reduce-scatter, next to the formula and to torch's FSDP1")
    gb.add_argument("--world-size", type=int, default=2)
    gb.add_argument("--markdown", default=None)

    eu = sub.add_parser("embedding-units", help="chapter 6: an untied embedding and output head in the root or as "
                                                "units of their own: unsharded bytes alive at once, bytes sent")
    eu.add_argument("--world-size", type=int, default=2)
    eu.add_argument("--markdown", default=None)

    units = sub.add_parser("units", help="chapter 6: FSDP's units, their payloads and bytes, computed and counted")
    units.add_argument("--world-size", type=int, default=2)
    units.add_argument("--markdown", default=None)

    phases = sub.add_parser("phases", help="chapter 6: memory at each phase of a step, DDP to FSDP")
    phases.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    phases.add_argument("--plot", default="fsdp_phases.svg")
    phases.add_argument("--plot-world-size", type=int, default=None,
                        help="the world size the plot shows (default: the last of --world-sizes)")
    phases.add_argument("--markdown", default=None)

    tl = sub.add_parser("timeline", help="chapter 7: timelines of one FSDP step per prefetch mode, on a slow link")
    tl.add_argument("--world-size", type=int, default=2)
    tl.add_argument("--bandwidth", type=float, default=100e6, help="bytes/s per rank of the simulated link")
    tl.add_argument("--latency", type=float, default=1e-3, help="seconds per collective on the simulated link")
    tl.add_argument("--plot", default="timelines.svg")
    tl.add_argument("--trace", default=None, help="also write the last mode's Chrome/Perfetto trace (JSON)")
    tl.add_argument("--markdown", default=None)

    pm = sub.add_parser("prefetch-memory", help="chapter 7: peak parameter memory with and without prefetching")
    pm.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    pm.add_argument("--markdown", default=None)

    prec = sub.add_parser("precision", help="chapter 8: memory and bytes across precisions and offload; loss curves")
    prec.add_argument("--world-size", type=int, default=2)
    prec.add_argument("--curve-steps", type=int, default=300)
    prec.add_argument("--markdown", default=None)
    prec.add_argument("--plot", default=None)

    f32 = sub.add_parser("fp32-modules", help="chapter 8: MixedPrecision(_module_classes_to_ignore=...): the LayerNorms "
                                              "as units of their own in fp32, next to all-bf16 and to torch's FSDP1")
    f32.add_argument("--world-size", type=int, default=2)
    f32.add_argument("--steps", type=int, default=30)
    f32.add_argument("--markdown", default=None)

    opts = sub.add_parser("options", help="chapter 9: what accumulation, checkpointing and deferred init cost")
    opts.add_argument("--world-size", type=int, default=2)
    opts.add_argument("--markdown", default=None)

    acc = sub.add_parser("accumulation", help="chapter 9: bytes per micro-batch and memory between micro-batches "
                                              "under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, with and without no_sync")
    acc.add_argument("--world-size", type=int, default=2)
    acc.add_argument("--markdown", default=None)

    ck = sub.add_parser("checkpoints", help="chapter 10: checkpoint size on disk and save/load time per strategy")
    ck.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    ck.add_argument("--markdown", default=None)
    ck.add_argument("--plot", default=None, help="also draw which boxes each rank writes at N and reads at M")

    sdm = sub.add_parser("state-dict-memory", help="chapter 10: peak memory of taking a full state dict, whole model "
                                                   "at once vs unit by unit, rank0_only, offload_to_cpu")
    sdm.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    sdm.add_argument("--markdown", default=None)

    f2 = sub.add_parser("fsdp2", help="chapter 11: the FlatParameter FSDP, minifsdp's fully_shard and torch's; HSDP's bytes")
    f2.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    f2.add_argument("--markdown", default=None)

    par = sub.add_parser("parallel", help="chapter 12: tensor and sequence parallelism at t = 1, 2, 4; the column "
                                          "layers' input-gradient all-reduce behind their weight gradient, on a "
                                          "timeline; the pipeline schedules' bubbles; DDP, FSDP, TP, PP and their "
                                          "compositions on 4 ranks")
    par.add_argument("--parts", nargs="+", default=["tp", "overlap", "pp", "compare"],
                     choices=["tp", "overlap", "pp", "compare"])
    par.add_argument("--markdown", default=None, help="a file (one part), a directory (DIR/parallel_<part>.md) or a "
                                                      "prefix (PREFIX_<part>.md)")
    par.add_argument("--plot", default=".", help="where the overlap part draws its timelines and the pipeline part "
                                                 "its Gantt chart: a file (one of those parts), a directory "
                                                 "(DIR/tp_overlap.svg, DIR/pipeline_gantt.svg) or a prefix "
                                                 "(PREFIX_<part>.svg)")

    parity = sub.add_parser("parity", help="the parity matrix: every strategy on odd, tied, frozen, unused, BatchNorm, "
                                           "reused and float64 models vs torch's DDP (or FSDP1), at each world size")
    parity.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parity.add_argument("--markdown", default=None)

    gpu = sub.add_parser("gpu-check", help="every strategy on CUDA + NCCL vs torch's DDP: parity, allocator "
                                           "memory, bytes (says so and exits 0 without a GPU)")
    gpu.add_argument("--steps", type=int, default=5)
    gpu.add_argument("--markdown", default=None)

    stm = sub.add_parser("step-time", help="chapter 13: step time, tokens/s/GPU and MFU per strategy from the "
                                           "alpha-beta model; its calibration on gloo; its errors vs published runs")
    stm.add_argument("--models", nargs="+", default=["7b", "70b"], help="from: 7b 13b 70b llama3-8b llama3-70b")
    stm.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    stm.add_argument("--gpus-per-node", type=int, default=8)
    stm.add_argument("--gpu", default="h100", choices=["h100", "a100"])
    stm.add_argument("--seq-len", type=int, default=4096)
    stm.add_argument("--micro-batch", type=float, default=2, help="sequences per GPU per step")
    stm.add_argument("--no-calibrate", action="store_true", help="skip the measured gloo calibration")
    stm.add_argument("--markdown", default=None)
    stm.add_argument("--published", default=None, help="also write the comparison with published runs here")

    sim = sub.add_parser("simulate", help="chapter 13: the real wrappers as rank 0 of N (meta tensors, fake process "
                                          "group): memory per phase and bytes per collective vs the analytic model")
    sim.add_argument("--model", "--models", dest="models", nargs="+", default=["7b"],
                     help="from: 1b (TinyLlama 1.1B) 7b 13b 70b (Llama 2) 175b (GPT-3's shape) zero-7.5b fsdp-notes tiny")
    sim.add_argument("--world-size", "--world-sizes", dest="world_sizes", type=int, nargs="+", default=[8])
    sim.add_argument("--strategy", "--strategies", dest="strategies", nargs="+", default=["fsdp"],
                     help="from: ddp oss sdp fsdp fully_shard")
    sim.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "bf16-master"])
    sim.add_argument("--seq-len", type=int, default=4096)
    sim.add_argument("--micro-batch", type=int, default=1)
    sim.add_argument("--checkpoint-activations", action="store_true", help="recompute each layer in backward")
    sim.add_argument("--layers", type=int, default=None, help="override the model's number of decoder layers")
    sim.add_argument("--example", "--examples", dest="examples", nargs="+", default=[],
                     help="the seeds' worked examples instead: fsdp-notes zero-7.5b limit-all-gathers (or all)")
    sim.add_argument("--markdown", default=None)
    sim.add_argument("--plot", default=None, help="draw memory per rank vs N (a sweep)")

    demo = sub.add_parser("demo", help="all-reduce built from reduce-scatter + all-gather, checked")
    demo.add_argument("--world-size", type=int, default=3)

    student = sub.add_parser("student", help="write a student copy with the exercise solutions removed")
    student.add_argument("out_dir")
    student.add_argument("--only", default=None, help="remove just this exercise (e.g. 1.2)")
    student.add_argument("--chapters", default=None, help="remove just these chapters' exercises (e.g. 6,7)")
    student.add_argument("--pass-line", type=float, default=None, help="the most points (of 100) an exercise "
                         "scores when one of its mechanism tests fails; recorded in the copy (default: 60)")

    def grading_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--reference", default=None, help="the course project whose tests, configuration and "
                       "package are used (default: the project that holds the running minifsdp)")
        p.add_argument("--chapters", default=None, help="grade just these chapters (e.g. 6,7); every other "
                       "exercise keeps the reference's solution")
        p.add_argument("--timeout", type=float, default=None, help="seconds each chapter's tests may take "
                       "(default: 900)")
        p.add_argument("--pass-line", type=float, default=None, help="the most points (of 100) an exercise scores "
                       "when one of its mechanism tests fails (default: the student copy's, else 60)")

    grade = sub.add_parser("grade", help="score a submission chapter by chapter and exercise by exercise, on "
                                         "the reference's tests (only the code between the markers is graded)")
    grade.add_argument("path", nargs="?", default=".", help="the submission (a student copy with the work in it)")
    grading_options(grade)
    grade.add_argument("--json", default=None, help="also write the result as JSON to this file")
    grade.add_argument("--gradescope", default=None, help="also write Gradescope's results.json to this file")
    grade.add_argument("--junit", default=None, help="also keep pytest's JUnit XML, one file per chapter, here")

    grade_all = sub.add_parser("grade-all", help="grade every subdirectory of DIR as one submission; write "
                                                 "OUT/<name>.json and OUT/summary.csv")
    grade_all.add_argument("directory")
    grading_options(grade_all)
    grade_all.add_argument("--out", default="grades", help="where the results go (default: ./grades)")

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tour":
        from minifsdp.reports.tour import run_tour
        run_tour(world_size=args.world_size, steps=args.steps, device=args.device, plot=args.plot,
                 markdown=args.markdown, strategies=args.strategies, plot_world_size=args.plot_world_size)
    elif args.command == "memory":
        from minifsdp.reports.tour import run_memory_report
        run_memory_report(strategies=args.strategies, world_sizes=args.world_sizes, steps=args.steps, plot=args.plot, markdown=args.markdown, bars=args.bars, model=args.model)
    elif args.command == "partition":
        from minifsdp.reports.tour import run_partition_report
        run_partition_report(world_sizes=args.world_sizes, markdown=args.markdown)
    elif args.command == "grad-buffers":
        from minifsdp.reports.grad_buffers import run_grad_buffers_report
        run_grad_buffers_report(world_size=args.world_size, markdown=args.markdown)
    elif args.command == "embedding-units":
        from minifsdp.reports.embedding_units import run_embedding_units_report
        run_embedding_units_report(world_size=args.world_size, markdown=args.markdown)
    elif args.command == "units":
        from minifsdp.reports.phases import run_units_report
        run_units_report(world_size=args.world_size, markdown=args.markdown)
    elif args.command == "phases":
        from minifsdp.reports.phases import run_phases_report
        run_phases_report(world_sizes=args.world_sizes, plot=args.plot, markdown=args.markdown,
                          plot_world_size=args.plot_world_size)
    elif args.command == "timeline":
        from minifsdp.reports.overlap import run_timeline_report
        run_timeline_report(world_size=args.world_size, bandwidth=args.bandwidth, latency=args.latency,
                            plot=args.plot, trace=args.trace, markdown=args.markdown)
    elif args.command == "prefetch-memory":
        from minifsdp.reports.overlap import run_prefetch_memory_report
        run_prefetch_memory_report(world_sizes=args.world_sizes, markdown=args.markdown)
    elif args.command == "precision":
        from minifsdp.reports.precision import run_precision_report
        run_precision_report(world_size=args.world_size, markdown=args.markdown, plot=args.plot,
                             curve_steps=args.curve_steps)
    elif args.command == "fp32-modules":
        from minifsdp.reports.full_precision import run_full_precision_report
        run_full_precision_report(world_size=args.world_size, steps=args.steps, markdown=args.markdown)
    elif args.command == "options":
        from minifsdp.reports.options import run_options_report
        run_options_report(world_size=args.world_size, markdown=args.markdown)
    elif args.command == "accumulation":
        from minifsdp.reports.accumulation import run_accumulation_report
        run_accumulation_report(world_size=args.world_size, markdown=args.markdown)
    elif args.command == "checkpoints":
        from minifsdp.reports.checkpoints import run_checkpoint_report
        run_checkpoint_report(world_sizes=args.world_sizes, markdown=args.markdown, plot=args.plot)
    elif args.command == "state-dict-memory":
        from minifsdp.reports.state_dict_memory import report
        report(world_sizes=args.world_sizes, markdown=args.markdown)
    elif args.command == "fsdp2":
        from minifsdp.reports.fsdp2 import run_fsdp2_report
        run_fsdp2_report(world_sizes=args.world_sizes, markdown=args.markdown)
    elif args.command == "parallel":
        from minifsdp.reports.parallel import run_parallel_report
        run_parallel_report(parts=args.parts, markdown=args.markdown, plot=args.plot)
    elif args.command == "parity":
        from minifsdp.reports.parity import run_parity_report
        return run_parity_report(world_sizes=args.world_sizes, markdown=args.markdown)
    elif args.command == "gpu-check":
        from minifsdp.reports.gpu_check import run_gpu_check
        return run_gpu_check(markdown=args.markdown, steps=args.steps)
    elif args.command == "step-time":
        from minifsdp.reports.step_time import run_step_time_report
        run_step_time_report(models=args.models, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                             seq_len=args.seq_len, micro_batch=args.micro_batch, markdown=args.markdown,
                             published=args.published, calibrate=not args.no_calibrate)
    elif args.command == "simulate":
        from minifsdp.reports.simulate import run_simulate
        try:
            run_simulate(models=args.models, world_sizes=args.world_sizes, strategies=args.strategies,
                         precision=args.precision, seq_len=args.seq_len, micro_batch=args.micro_batch,
                         checkpoint_activations=args.checkpoint_activations, layers=args.layers,
                         markdown=args.markdown, plot=args.plot, examples=args.examples)
        except ValueError as e:
            print(f"minifsdp simulate: {e}", file=sys.stderr)
            return 2
    elif args.command == "demo":
        from minifsdp.ddp.collectives import demo_all_reduce_by_parts
        from minifsdp.distributed.launch import launch
        for r in launch(demo_all_reduce_by_parts, world_size=args.world_size, device="cpu"):
            parts = " + ".join(f"{kind} {b:.1f}" for kind, b in r["bytes_by_parts"].items())
            print(f"rank {r['rank']}: all_reduce {r['all_reduce']}\n"
                  f"        by_parts   {r['by_parts']}\n"
                  f"        bytes: all_reduce {r['bytes_all_reduce']:.1f}; by parts {parts}")
    elif args.command == "student":
        from pathlib import Path

        from minifsdp.course import write_student_copy
        from minifsdp.course.grade import default_reference, parse_chapters
        try:
            # the project in this directory, else the one the running minifsdp comes from (an editable install)
            project = "." if Path("minifsdp", "__init__.py").is_file() else default_reference()
            write_student_copy(project, args.out_dir, only=args.only, chapters=parse_chapters(args.chapters),
                               pass_line=args.pass_line)
        except (FileExistsError, FileNotFoundError, ValueError) as e:
            print(f"minifsdp student: {e}", file=sys.stderr)
            return 2
    elif args.command in ("grade", "grade-all"):
        from minifsdp.course.assignment import check_pass_line
        from minifsdp.course.grade import DEFAULT_TIMEOUT, grade, grade_all
        timeout = args.timeout or DEFAULT_TIMEOUT
        try:
            line = None if args.pass_line is None else check_pass_line(args.pass_line)
            if args.command == "grade":
                return grade(args.path, reference=args.reference, chapters=args.chapters, timeout=timeout,
                             json_path=args.json, gradescope=args.gradescope, junit_dir=args.junit, pass_line=line)
            return grade_all(args.directory, reference=args.reference, chapters=args.chapters, out=args.out,
                             timeout=timeout, pass_line=line)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            print(f"minifsdp {args.command}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
