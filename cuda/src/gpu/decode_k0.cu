// Decode kernel part 0 of decode.cu, compiled on its own so that the decode kernels build in parallel.
#define TZIP_DECODE_PART 0
#include "decode.cu"
