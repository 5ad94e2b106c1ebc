"""Products of a decode step's few rows with a layer's weights, the block's norm before and its
residual add after in the same kernels (a decode step's MLP in two kernels; a mixer's input
projection with its norm, its output projection with the residual). Callers use api.py only.

  api.py          the entry points (`mlp`, `norm_matmul`, `norm_swiglu`, `matmul_residual`), their
                  shape checks
  reference.py    the XLA form they replace (plain jnp)
  triton_rows.py  the Pallas kernels (Triton lowering)
"""
