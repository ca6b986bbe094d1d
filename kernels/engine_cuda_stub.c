/* engine_cuda_stub.c: placeholder until kernels/engine_cuda.c exists; the
 * rule engine on the GPU replaces this file (delete it then). */
#include "cuda.h"

void mn_cuda_engine_register(void) {}
