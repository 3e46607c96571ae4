"""kernels: KV-cache quantisation, attention over quantised / paged caches, GPU kernels with a
plain-PyTorch reference for each."""
