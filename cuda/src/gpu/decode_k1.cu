// Decode kernel part 1 of decode.cu, compiled on its own so that the decode kernels build in parallel.
#define TZIP_DECODE_PART 1
#include "decode.cu"
