"""minipic-bench: cli.py and one module per subcommand (`attention`, `engine`, `gdn`, `planner`,
`hybrid-cache`, `hybrid-step`, `hybrid-spans` (hybrid_span_request.py; its `--steps` trace:
hybrid_span_steps.py), `rag`, `route`,
`write-kv`, `train`, `block-ft`, `rl`, `cpu-vs-hf`, `lower-time` (lower_time.py: the step
variants' trace and lower for CUDA on this CPU));
a subcommand's parts in files named after it (attention_decode.py, engine_host.py, ...).
Standalone: kv_store_bench.py, cached_span_attention.py, span_step_ops.py, span_step_work.py,
fixed_step_work.py (a hybrid prefill step's work that does not scale with its tokens),
rag_steps.py, rag_flow_rows.py, page_zeroing_cost.py, cached_admission.py, free_room_ab.py, live_bytes.py (device
memory by owner per stage of the engine bench), gdn_decode_bench.py, hlo_kernels.py (a compiled
step's kernels by the named scope they come from) (python -m benchmarks.<name>).
Shared: timing.py, engine_args.py (one flag and help per engine option), compile_counter.py (XLA
compiles apart from persistent-cache loads), program_forms.py (program-switch forms for
in-process A/Bs). Workloads from shipped data in data/.
Figures: RESULTS.md; their raw data: runs/; the past: history/ (its README.md indexes it).
"""
