/* cuda_runtime_api.h - the emulator's runtime API (cuda_runtime.h). */
#include "cuda_runtime.h"
