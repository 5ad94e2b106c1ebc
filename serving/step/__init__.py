"""serving.step: the device step; imports cache, hybrid (and the records).

  model_runner.py      one jitted (forward + sample) call per step
  kernel_choices.py    attention and gated delta kernels chosen once at start (Config)
  step_inputs.py       the packed int32 input buffer, per-seat block-table rows, row fills
  resident_tables.py   the seats' block tables kept on the device, changed runs sent per step
  step_executables.py  the step's compiled variants, readied up front, called directly
  executable_store.py  compiled steps on disk, keyed so a changed program never loads
  program_switches.py  the module switches (A/B forms) that shape a step, part of that key
  compile_options.py   XLA compiler options of the steps (command buffers on a GPU)
  sampler.py           sampling on device: greedy, temperature, top-k/p, logprobs
  sharding.py          tensor parallelism: mesh, logical-axis rules, param and pool placement
  state_placement.py   under TP: the cache and recurrent pools placed by the rules, step after step
"""
