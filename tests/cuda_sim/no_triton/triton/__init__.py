# Put first on PYTHONPATH for the AddressSanitizer run of tests/test_cuda_sim.py only: the
# triton wheel's native module aborts under a preloaded ASan runtime (its C++ exceptions
# fail the runtime's __cxa_throw interceptor), and the emulated kernels do not need it.
# torch treats the ImportError as "triton is not installed".
raise ImportError("triton is hidden during the sanitizer run of the CUDA emulation")
