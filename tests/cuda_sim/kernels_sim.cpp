// The CUDA kernels, unchanged, compiled as host C++ against the emulated device (Note
// [CUDA emulation] in csrc/cuda_sim/cuda_sim.h; csrc/cuda_sim is first on the include path).
#include "cuda/adamw_cuda.cu"
#include "cuda/grad_stats_cuda.cu"
#include "cuda/quant4_cuda.cu"
#include "cuda/quant8_cuda.cu"
