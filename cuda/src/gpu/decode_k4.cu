// Decode kernel part 4 of decode.cu (bf16 max frames), compiled on its own so that the decode kernels build in
// parallel.
#define TZIP_DECODE_PART 4
#include "decode.cu"
