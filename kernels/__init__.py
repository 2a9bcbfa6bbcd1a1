"""Device code: attention backends and (later) fused kernels. Importing this package never needs CUDA."""
