// The emulated CUDA runtime (Note [CUDA emulation] in cuda_sim.h): on the include path
// before any CUDA toolkit when the kernels are built for the emulator.
#pragma once
#include "cuda_sim.h"
