"""GPU hot-path kernels. Each module holds a Triton kernel, its checked public wrapper, and a
plain-torch reference with the same signature (``*_ref``) that the CPU engine uses and tests compare to."""
