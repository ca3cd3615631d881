/* gpu_check.h - the parts of gpu_check that live in separate files. */
#ifndef SCAPE_GPU_CHECK_H
#define SCAPE_GPU_CHECK_H

#include "gpu_common.h"

/* Call every kern_cuda_* function with bad arguments and expect
 * SCAPE_INVALID with a message naming the function, and an unknown
 * segmented kernel id; also the valid empty-segment calls. */
void check_bad_args(gc_tally *t);

#endif /* SCAPE_GPU_CHECK_H */
