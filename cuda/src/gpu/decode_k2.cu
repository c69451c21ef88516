// Decode kernel part 2 of decode.cu, compiled on its own so that the decode kernels build in parallel.
#define TZIP_DECODE_PART 2
#include "decode.cu"
