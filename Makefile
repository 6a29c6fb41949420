# Every figure and table in the docs is made by one of these commands (see chapters/*.md).
PY ?= python

.PHONY: setup test tour diagrams figures notebooks docs docs-student serve student grade grading bypasses

setup:            ## install minifsdp and what the tests need (CPU torch on a machine without a GPU)
	bash .ci/setup

test: setup       ## the whole suite, as CI runs it
	$(PY) -m pytest -q

tour: setup       ## the main job: every strategy side by side on 2 CPU ranks
	$(PY) -m minifsdp tour

diagrams:         ## draw the chapters' SVG diagrams (plain Python: chapters/diagrams/make_diagrams.py)
	$(PY) chapters/diagrams/make_diagrams.py \
	    chapters/figures/diagrams/ring_allreduce.svg chapters/figures/diagrams/ddp_buckets.svg chapters/figures/diagrams/zero_stages.svg \
	    chapters/figures/diagrams/oss_partition.svg chapters/figures/diagrams/flat_parameter.svg chapters/figures/diagrams/fsdp_unit_lifecycle.svg \
	    chapters/figures/diagrams/backward_prefetch.svg chapters/figures/diagrams/mixed_precision.svg chapters/figures/diagrams/activation_checkpointing.svg \
	    chapters/figures/diagrams/checkpoint_reshard.svg chapters/figures/diagrams/hsdp_mesh.svg chapters/figures/diagrams/tp_f_g.svg \
	    chapters/figures/diagrams/pipeline_1f1b.svg \
	    chapters/figures/diagrams/overlap_step.svg chapters/figures/diagrams/two_all_gather_buffers.svg chapters/figures/diagrams/allocator_retry.svg \
	    chapters/figures/diagrams/prefetch_next_unit.svg \
	    chapters/figures/diagrams/float_formats.svg chapters/figures/diagrams/main_grad.svg chapters/figures/diagrams/loss_scale_agreement.svg chapters/figures/diagrams/cpu_offload.svg \
	    chapters/figures/diagrams/cast_shard_contract.svg \
	    chapters/figures/diagrams/flat_param_states.svg chapters/figures/diagrams/flat_param_storage.svg \
	    chapters/figures/diagrams/flat_param_grad.svg chapters/figures/diagrams/flat_param_tied.svg \
	    chapters/figures/diagrams/flat_param_why.svg chapters/figures/diagrams/flat_param_views.svg \
	    chapters/figures/diagrams/checkpoint_layouts.svg chapters/figures/diagrams/checkpoint_boxes.svg \
	    chapters/figures/diagrams/checkpoint_state_dicts.svg chapters/figures/diagrams/checkpoint_atomic.svg \
	    chapters/figures/diagrams/fsdp_wrap_units.svg chapters/figures/diagrams/fsdp_step.svg chapters/figures/diagrams/fsdp_hooks.svg chapters/figures/diagrams/fsdp_raf_nraf.svg \
	    chapters/figures/diagrams/fsdp1_strategies.svg \
	    chapters/figures/diagrams/tp_block.svg chapters/figures/diagrams/tp_vocab_loss.svg chapters/figures/diagrams/tp_sequence_parallel.svg chapters/figures/diagrams/tp_init.svg chapters/figures/diagrams/pp_stages.svg chapters/figures/diagrams/pipeline_p2p.svg chapters/figures/diagrams/parallel_mesh.svg \
	    chapters/figures/diagrams/pipeline_interleaved_contract.svg \
	    chapters/figures/diagrams/alpha_beta.svg chapters/figures/diagrams/two_level_network.svg chapters/figures/diagrams/nraf_step.svg chapters/figures/diagrams/published_errors.svg \
	    chapters/figures/diagrams/simulate_contract.svg \
	    chapters/figures/diagrams/ddp_naive_vs_overlap.svg chapters/figures/diagrams/four_collectives.svg \
	    chapters/figures/diagrams/ddp_bucket_order.svg chapters/figures/diagrams/ddp_no_sync.svg \
	    chapters/figures/diagrams/ddp_bucket_policy.svg \
	    chapters/figures/diagrams/oss_step.svg chapters/figures/diagrams/oss_when_it_pays.svg chapters/figures/diagrams/flat_oss_step.svg \
	    chapters/figures/diagrams/zero2_where_gradients_go.svg chapters/figures/diagrams/sdp_buckets.svg chapters/figures/diagrams/sdp_bucket_size.svg \
	    chapters/figures/diagrams/sdp_owner_buckets_contract.svg \
	    chapters/figures/diagrams/road.svg \
	    chapters/figures/diagrams/rank_memory.svg chapters/figures/diagrams/step_memory.svg chapters/figures/diagrams/launch_ranks.svg \
	    chapters/figures/diagrams/memory_terms.svg \
	    chapters/figures/diagrams/training_step.svg chapters/figures/diagrams/accumulation_no_sync.svg chapters/figures/diagrams/clip_from_shards.svg chapters/figures/diagrams/deferred_init_memory.svg chapters/figures/diagrams/deferred_init_replay.svg chapters/figures/diagrams/per_parameter_shards.svg chapters/figures/diagrams/class_swap.svg chapters/figures/diagrams/copy_in_out.svg chapters/figures/diagrams/unshard_async_op.svg

figures: diagrams ## regenerate every figure and table the chapters include
	$(PY) -m minifsdp tour --world-size 2 --steps 5 --plot-world-size 4 --plot chapters/figures/tour_memory.svg --markdown chapters/generated/tour_ws2.md
	$(PY) -m minifsdp.reports.models --markdown chapters/generated/models.md
	$(PY) -m minifsdp.reports.exercises --markdown chapters/generated/exercises.md
	$(PY) -m minifsdp.reports.grading --markdown chapters/generated/grading.md
	$(PY) -m minifsdp memory --world-sizes 1 2 3 4 --bars peak --plot chapters/figures/ddp_memory.svg --markdown chapters/generated/ddp_memory.md
	$(PY) -m minifsdp demo --world-size 3 > chapters/generated/demo_ws3.txt
	$(PY) -m minifsdp memory --strategies ddp oss sdp --world-sizes 1 2 3 4 --plot chapters/figures/zero12_memory.svg --markdown chapters/generated/zero12_memory.md
	$(PY) -m minifsdp memory --strategies oss sdp oss_flat sdp_flat --model states-heavy --world-sizes 2 3 4 --bars peak --plot chapters/figures/zero2_peak.svg --markdown chapters/generated/zero2_peak.md
	$(PY) -m minifsdp partition --world-sizes 2 3 4 5 6 7 8 --markdown chapters/generated/partition.md
	$(PY) -m minifsdp grad-buffers --world-size 2 --markdown chapters/generated/gradient_buffers.md
	$(PY) -m minifsdp units --world-size 2 --markdown chapters/generated/fsdp_units.md
	$(PY) -m minifsdp embedding-units --world-size 2 --markdown chapters/generated/embedding_units.md
	$(PY) -m minifsdp phases --world-sizes 1 2 3 4 --plot chapters/figures/fsdp_phases.svg --plot-world-size 2 --markdown chapters/generated/fsdp_phases.md
	$(PY) -m minifsdp timeline --world-size 2 --plot chapters/figures/timelines.svg --markdown chapters/generated/timelines.md
	$(PY) -m minifsdp prefetch-memory --world-sizes 2 4 --markdown chapters/generated/prefetch_memory.md
	$(PY) bench/fsdp_vs_torch.py > chapters/generated/fsdp_bench.md
	$(PY) bench/memory_family.py --markdown chapters/generated/memory_family.md
	$(PY) bench/sweep.py --sizes 1M 3M 10M 30M --world-sizes 1 2 4 --plot chapters/figures/cost_curves.svg --markdown chapters/generated/cost_curves.md
	$(PY) -m minifsdp precision --world-size 2 --markdown chapters/generated/precision.md --plot chapters/figures/precision_loss.svg
	$(PY) -m minifsdp options --world-size 2 --markdown chapters/generated/training_options.md
	$(PY) -m minifsdp accumulation --world-size 2 --markdown chapters/generated/accumulation.md
	$(PY) -m minifsdp fp32-modules --world-size 2 --markdown chapters/generated/fp32_modules.md
	$(PY) -m minifsdp state-dict-memory --world-sizes 2 4 --markdown chapters/generated/state_dict_memory.md
	$(PY) -m minifsdp checkpoints --world-sizes 1 2 3 4 --markdown chapters/generated/checkpoints.md --plot chapters/figures/reshard.svg
	$(PY) -m minifsdp fsdp2 --world-sizes 2 4 --markdown chapters/generated/fsdp2.md
	$(PY) -m minifsdp parallel --parts tp --markdown chapters/generated/parallel_tp.md
	$(PY) -m minifsdp parallel --parts overlap --markdown chapters/generated/parallel_overlap.md --plot chapters/figures/tp_overlap.svg
	$(PY) -m minifsdp parallel --parts pp --markdown chapters/generated/parallel_pp.md --plot chapters/figures/pipeline_gantt.svg
	$(PY) -m minifsdp parallel --parts compare --markdown chapters/generated/parallel_compare.md
	$(PY) -m minifsdp parity --world-sizes 1 2 3 4 --markdown chapters/generated/parity.md
	$(PY) -m minifsdp step-time --models 7b 70b --nodes 1 8 --gpus-per-node 8 --markdown chapters/generated/step_time.md --published chapters/generated/step_time_vs_published.md
	$(PY) -m minifsdp simulate --model 7b 70b --world-sizes 8 16 32 64 128 256 512 1024 --strategy ddp oss sdp fsdp fully_shard --plot chapters/figures/scaling_memory.svg --markdown chapters/generated/scaling_memory.md
	$(PY) -m minifsdp simulate --example all --markdown chapters/generated/worked_examples.md
	grep -cvE '^\s*(#|$$)' minifsdp/ddp/ddp.py minifsdp/zero/oss.py minifsdp/zero/sdp.py minifsdp/zero/flat.py minifsdp/zero/flat_state.py minifsdp/zero/flat_sdp.py > chapters/generated/loc.txt

notebooks:        ## run every notebook on CPU ranks and store its outputs (and its code's hash: tests/test_notebooks.py)
	$(PY) -m minifsdp.reports.notebooks

docs:             ## build the site into site/ (fails on any broken link or include)
	$(PY) -m mkdocs build --strict

docs-student:     ## the students' site, into site-student/: the exercises' placeholders and no solutions
	MINIFSDP_SITE=student $(PY) -m mkdocs build --strict --site-dir site-student

serve:
	$(PY) -m mkdocs serve

student:          ## a student copy with the exercise solutions removed, in ./student
	$(PY) -m minifsdp student student

grade:            ## run each chapter's tests and print a per-chapter score
	$(PY) -m minifsdp grade .

grading:          ## what grading costs: an untouched student copy, a solved copy, one chapter (the guide's table)
	$(PY) -m minifsdp.reports.grading --markdown chapters/generated/grading.md

bypasses:         ## every wrong solution in instructor/bypasses/ against every test of its exercise
	$(PY) instructor/bypasses/check.py
