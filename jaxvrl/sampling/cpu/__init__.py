"""CPU-only forms of the sampler's decode steps: the kernels (`kernels`, XLA FFI custom calls
compiled on first use) and the decode weights and cached attention built on them (`decode`).
The sampler chooses them for programs compiled for the CPU (`steps.decode_forms`)."""
