// Decode kernel part 3 of decode.cu (bf16 fast frames), compiled on its own so that the decode kernels build in
// parallel.
#define TZIP_DECODE_PART 3
#include "decode.cu"
