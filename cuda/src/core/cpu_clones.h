// TZIP_CPU_CLONES: compile a hot CPU function twice, for AVX2 and for the x86-64 baseline, and pick one at load time
// (GCC's target_clones, an ifunc), so that one build runs on every x86-64 machine and uses AVX2 where it exists.
// The clones compute the same integers: only the instructions differ, never the bytes. `flatten` inlines every call
// into each clone (the per-symbol steps of cuda/include/tzip, chunk_digest, the stream decoders), so that they are
// compiled for its target too: a call left out of line would run the baseline copy. Elsewhere (other architectures,
// nvcc) it is empty.
#pragma once

// GCC only: Clang refuses target_clones with flatten (the fuzz build, scripts/fuzz.sh, uses Clang: it gets the
// baseline code, which is the same code the default clone runs).
#if defined(__x86_64__) && defined(__ELF__) && !defined(__CUDACC__) && defined(__GNUC__) && !defined(__clang__)
#define TZIP_CPU_CLONES __attribute__((target_clones("avx2", "default"), flatten))
#else
#define TZIP_CPU_CLONES
#endif
